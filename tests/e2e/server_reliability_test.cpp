// `nucleus serve` against what a careless or hostile client sends: limits on
// bodies, headers, JSON nesting, choices and stop lists; slow and idle
// connections; pipelining; clients that go away; out-of-vocabulary ids; and
// memory after large requests. Each case checks the status and message, that
// the server answers the next request as before, and that no KV block leaks.
#include <poll.h>
#include <zlib.h>

#include "server_util.h"

namespace nucleus {
namespace {

using nlohmann::json;
using namespace nucleus::testing;
using Clock = std::chrono::steady_clock;

// A raw TCP connection to the server, for what httplib's client will not send.
class RawConn {
 public:
  explicit RawConn(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  }
  ~RawConn() { close(); }
  bool connected() const { return connected_; }
  int fd() const { return fd_; }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  // False when the server closed or reset the connection.
  bool send(const std::string& data) {
    size_t off = 0;
    while (off < data.size()) {
      ssize_t n = ::send(fd_, data.data() + off, data.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  }
  // Whether the server closed the connection within `timeout_s` (reads and
  // drops what it sends meanwhile).
  bool closed_within(double timeout_s) {
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
    char buf[4096];
    while (Clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) return true;
      received_.append(buf, static_cast<size_t>(n));
    }
    return false;
  }

  struct Response {
    int status = 0;  // 0: none (closed or timed out)
    std::map<std::string, std::string> headers;  // names lower-cased
    std::string body;
  };
  // Reads one response (Content-Length or chunked), waiting `timeout_s`.
  Response read_response(double timeout_s = 30.0) {
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
    Response r;
    size_t head_end;
    while ((head_end = received_.find("\r\n\r\n")) == std::string::npos)
      if (!fill(deadline)) return r;
    std::istringstream head(received_.substr(0, head_end));
    received_.erase(0, head_end + 4);
    std::string line;
    std::getline(head, line);
    r.status = std::atoi(line.substr(9, 3).c_str());
    while (std::getline(head, line)) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      const size_t colon = line.find(':');
      if (colon == std::string::npos) continue;
      std::string name = line.substr(0, colon);
      for (auto& ch : name) ch = static_cast<char>(std::tolower(ch));
      r.headers[name] = line.substr(line.find_first_not_of(' ', colon + 1));
    }
    if (r.headers.count("content-length")) {
      const size_t len = std::stoul(r.headers["content-length"]);
      while (received_.size() < len)
        if (!fill(deadline)) return Response{};
      r.body = received_.substr(0, len);
      received_.erase(0, len);
    } else if (r.headers["transfer-encoding"] == "chunked") {
      for (;;) {
        size_t eol;
        while ((eol = received_.find("\r\n")) == std::string::npos)
          if (!fill(deadline)) return Response{};
        const size_t len = std::stoul(received_.substr(0, eol), nullptr, 16);
        while (received_.size() < eol + 2 + len + 2)
          if (!fill(deadline)) return Response{};
        r.body += received_.substr(eol + 2, len);
        received_.erase(0, eol + 2 + len + 2);
        if (len == 0) break;
      }
    }
    return r;
  }

 private:
  bool fill(Clock::time_point deadline) {
    char buf[65536];
    while (Clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) return false;
      received_.append(buf, static_cast<size_t>(n));
      return true;
    }
    return false;
  }

  int fd_ = -1;
  bool connected_ = false;
  std::string received_;
};

std::string request(const std::string& method, const std::string& path, const std::string& body,
                    const std::string& extra_headers = "") {
  return method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + extra_headers +
         "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

std::string gzip(const std::string& data) {
  z_stream z{};
  deflateInit2(&z, 9, Z_DEFLATED, 15 + 16, 9, Z_DEFAULT_STRATEGY);
  std::string out(deflateBound(&z, data.size()), '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  z.avail_in = static_cast<uInt>(data.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

// Resident memory of a process, in bytes.
int64_t rss_bytes(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return -1;
}

const json kOneToken = {{"prompt", "x = 1"}, {"max_tokens", 1}, {"temperature", 0}};

class ReliabilityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new ServerProcess({"--max-body-bytes", "1048576", "--request-timeout", "1", "--keep-alive-timeout", "1",
                                 "--max-connections", "48", "--max-header-bytes", "8192"});
  }
  static void TearDownTestSuite() { delete server_; }
  void SetUp() override { ASSERT_TRUE(server_->ready()) << "server did not start:\n" << server_->log(); }
  const ServerProcess& s() const { return *server_; }
  std::map<std::string, double> metrics() const {
    auto res = s().client().Get("/metrics");
    return res && res->status == 200 ? parse_metrics(res->body) : std::map<std::string, double>{};
  }
  // The server still answers a one-token greedy request as before, and holds
  // no KV block once it is done.
  void expect_serving() {
    Reply r = post(s(), "/v1/completions", kOneToken);
    ASSERT_EQ(r.status, 200) << r.body;
    if (reference_.empty()) reference_ = r.body["choices"][0]["text"];
    EXPECT_EQ(r.body["choices"][0]["text"], reference_);
    std::map<std::string, double> m;
    for (int i = 0; i < 100; ++i) {
      m = metrics();
      if (m["nucleus_kv_blocks_used"] == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_EQ(m["nucleus_kv_blocks_used"], 0);
  }
  RawConn::Response raw(const std::string& bytes) {
    RawConn c(s().port());
    EXPECT_TRUE(c.connected());
    c.send(bytes);
    return c.read_response();
  }

  static ServerProcess* server_;
  static std::string reference_;
};
ServerProcess* ReliabilityTest::server_ = nullptr;
std::string ReliabilityTest::reference_;

TEST_F(ReliabilityTest, DeeplyNestedJsonIs400AndTheServerLives) {
  expect_serving();
  const int depth = 75000;
  const std::string deep_array = std::string(depth, '[') + std::string(depth, ']');
  const std::string deep_object = [&] {
    std::string s;
    for (int i = 0; i < depth; ++i) s += "{\"a\":";
    return s + "1" + std::string(depth, '}');
  }();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"/v1/completions", R"({"prompt": "x", "temperature": )" + deep_array + "}"},
      {"/v1/completions", deep_array},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": )" + deep_object + "}]}"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "hi"}], "tools": )" + deep_array + "}"},
      {"/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": )" + deep_object + "}"},
  };
  for (const auto& [path, body] : cases) {
    Reply r = post(s(), path, body);
    EXPECT_EQ(r.status, 400) << path;
    EXPECT_NE(r.body.dump().find("--max-json-depth"), std::string::npos) << r.body;
  }
  // Strings may hold any brackets.
  Reply ok = post(s(), "/v1/completions", json{{"prompt", std::string(5000, '[')}, {"max_tokens", 1}});
  EXPECT_NE(ok.status, 0);
  EXPECT_NE(ok.body.dump().find("maximum context length"), std::string::npos) << ok.body;
  expect_serving();
}

TEST_F(ReliabilityTest, BodyLimitHoldsForEveryFraming) {
  // Content-Length past the limit: 413 before the body is sent.
  RawConn big(s().port());
  ASSERT_TRUE(big.send("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       "Content-Length: 104857600\r\n\r\n"));
  auto r = big.read_response(5);
  EXPECT_EQ(r.status, 413);
  EXPECT_TRUE(big.closed_within(2));
  // Chunked past the limit.
  RawConn chunked(s().port());
  std::string head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
  ASSERT_TRUE(chunked.send(head));
  const std::string piece(65536, ' ');
  for (int i = 0; i < 40; ++i)
    if (!chunked.send("10000\r\n" + piece + "\r\n")) break;  // the server may stop reading at 1 MiB
  r = chunked.read_response(5);
  EXPECT_EQ(r.status, 413);
  // A gzip body that inflates past the limit (64 KiB -> 64 MiB).
  const std::string bomb = gzip(std::string(64 << 20, ' '));
  ASSERT_LT(bomb.size(), 1u << 20);
  r = raw(request("POST", "/v1/completions", bomb, "Content-Encoding: gzip\r\n"));
  EXPECT_EQ(r.status, 413);
  EXPECT_NE(r.body.find("inflates"), std::string::npos) << r.body;
  // A gzip body within the limit is read like a plain one.
  r = raw(request("POST", "/v1/completions", gzip(kOneToken.dump()), "Content-Encoding: gzip\r\n"));
  EXPECT_EQ(r.status, 200) << r.body;
  r = raw(request("POST", "/v1/completions", kOneToken.dump(), "Content-Encoding: br\r\n"));
  EXPECT_EQ(r.status, 415);
  // Headers past --max-header-bytes.
  r = raw(request("GET", "/health", "", "X-Big: " + std::string(10000, 'a') + "\r\n"));
  EXPECT_EQ(r.status, 431);
  // Malformed requests.
  EXPECT_EQ(raw("GARBAGE\r\n\r\n").status, 400);
  EXPECT_EQ(raw("POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n").status, 400);
  expect_serving();
}

// Chunked trailers count against --max-header-bytes (they were counted
// against no limit: 1.2 GB of them on one connection were read and kept), and
// a header or trailer field longer than the parser's field limit is a 431
// (its exception escaped the reader and aborted the server).
TEST_F(ReliabilityTest, TrailersAreHeldToTheHeaderLimitAndLongFieldsAre431) {
  const std::string head = "GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
  auto r = raw(head + "0\r\nT: " + std::string(65534, 't') + "\r\n\r\n");
  EXPECT_EQ(r.status, 431) << r.body;
  expect_serving();
  RawConn many(s().port());
  ASSERT_TRUE(many.send(head + "0\r\n"));
  const std::string line = "T: " + std::string(4000, 't') + "\r\n";
  for (int i = 0; i < 2000; ++i)  // 8 MB of trailers; the server stops reading at the limit
    if (!many.send(line)) break;
  r = many.read_response(5);
  EXPECT_EQ(r.status, 431) << r.body;
  EXPECT_NE(r.body.find("trailers"), std::string::npos) << r.body;
  // Trailers within the limit are read as before.
  r = raw(head + "0\r\nT: small\r\n\r\n");
  EXPECT_EQ(r.status, 200) << r.body;
  expect_serving();
}

TEST_F(ReliabilityTest, SlowlorisConnectionsAreCutAndOthersAreServed) {
  // 32 connections that send a header line every 200 ms and never finish.
  std::vector<std::unique_ptr<RawConn>> slow;
  for (int i = 0; i < 32; ++i) {
    slow.push_back(std::make_unique<RawConn>(s().port()));
    ASSERT_TRUE(slow.back()->send("POST /v1/completions HTTP/1.1\r\nHost: x\r\n"));
  }
  const auto start = Clock::now();
  bool served = false;
  int cut = 0;
  std::vector<bool> gone(slow.size(), false);
  while (Clock::now() - start < std::chrono::milliseconds(3000)) {
    for (size_t i = 0; i < slow.size(); ++i)
      if (!gone[i] && !slow[i]->send("X-Slow: 1\r\n")) gone[i] = true;
    if (!served) {
      const auto t0 = Clock::now();
      Reply r = post(s(), "/v1/completions", kOneToken);
      EXPECT_EQ(r.status, 200);
      EXPECT_LT(Clock::now() - t0, std::chrono::seconds(10));
      served = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  // --request-timeout 1: every slow connection got 408 and was closed.
  for (auto& c : slow) {
    if (c->closed_within(1.0)) ++cut;
  }
  EXPECT_EQ(cut, 32);
  EXPECT_TRUE(served);
  expect_serving();
}

TEST_F(ReliabilityTest, IdleConnectionsCloseAndTheConnectionLimitRefuses) {
  RawConn idle(s().port());
  ASSERT_TRUE(idle.connected());
  EXPECT_TRUE(idle.closed_within(3.0));  // --keep-alive-timeout 1
  // --max-connections 48: one more is answered 503 at once. (Until the
  // server has accepted all 48, a try may still be let in: try again.)
  std::vector<std::unique_ptr<RawConn>> held;
  for (int i = 0; i < 48; ++i) held.push_back(std::make_unique<RawConn>(s().port()));
  RawConn::Response r;
  for (int attempt = 0; attempt < 20 && r.status != 503; ++attempt) {
    RawConn extra(s().port());
    r = extra.read_response(0.5);
  }
  EXPECT_EQ(r.status, 503);
  EXPECT_NE(r.body.find("--max-connections"), std::string::npos);
  held.clear();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  expect_serving();
}

TEST_F(ReliabilityTest, PipelinedRequestsAreAnsweredInOrder) {
  RawConn c(s().port());
  const std::string body = kOneToken.dump();
  ASSERT_TRUE(c.send(request("GET", "/health", "") + request("POST", "/v1/completions", body) +
                     request("GET", "/v1/models", "") + request("PATCH", "/v1/completions", "")));
  auto a = c.read_response(), b = c.read_response(), m = c.read_response(), p = c.read_response();
  EXPECT_EQ(a.status, 200);
  EXPECT_EQ(b.status, 200);
  EXPECT_NE(b.body.find("text_completion"), std::string::npos);
  EXPECT_EQ(m.status, 200);
  EXPECT_NE(m.body.find("\"list\""), std::string::npos);
  EXPECT_EQ(p.status, 405);
  EXPECT_EQ(p.headers["allow"], "POST");
  // Keep-alive: the same connection serves a later request too.
  ASSERT_TRUE(c.send(request("GET", "/health", "")));
  EXPECT_EQ(c.read_response().status, 200);
}

TEST_F(ReliabilityTest, DisconnectedNonStreamingClientIsAbortedAndFreesItsBlocks) {
  auto before = metrics();
  {
    RawConn c(s().port());
    ASSERT_TRUE(c.send(request("POST", "/v1/completions",
                               json{{"prompt", "def f(x):\n"}, {"max_tokens", 900}, {"ignore_eos", true}}.dump())));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }  // closed
  const std::string abort = "nucleus_requests_finished_total{finish_reason=\"abort\"}";
  std::map<std::string, double> after;
  for (int i = 0; i < 150; ++i) {
    after = metrics();
    if (after[abort] - before[abort] >= 1 && after["nucleus_kv_blocks_used"] == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(after[abort] - before[abort], 1);
  EXPECT_EQ(after["nucleus_kv_blocks_used"], 0);
  EXPECT_LT(after["nucleus_generation_tokens_total"] - before["nucleus_generation_tokens_total"], 900);
  const auto t0 = Clock::now();
  expect_serving();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
}

TEST_F(ReliabilityTest, RequestLimitsAre400NamingTheField) {
  struct Case {
    json body;
    std::string param, message;
  };
  const std::string big_stop(2000, 'z');
  std::vector<Case> cases = {
      {{{"prompt", "x"}, {"n", 257}}, "n", "[1, 256]"},
      {{{"prompt", json::array({"a", "b", "c", "d"})}, {"n", 65}}, "prompt", "--max-choices"},
      {{{"prompt", "x"}, {"stop", std::vector<std::string>(65, "s")}}, "stop", "--max-stop-strings"},
      {{{"prompt", "x"}, {"stop", std::vector<std::string>(10, big_stop)}}, "stop", "--max-stop-bytes"},
      {{{"prompt", "x"}, {"stop_token_ids", std::vector<int>(1025, 5)}}, "stop_token_ids", "--max-stop-token-ids"},
      {{{"prompt", "x"}, {"n", 1024}, {"stop", std::vector<std::string>(8, big_stop)}}, "n", "[1, 256]"},
      {{{"prompt", "x"}, {"temperature", 18446744073709551616.0}}, "temperature", "temperature"},
      {{{"prompt", "x"}, {"structured_outputs", {{"choice", std::vector<std::string>(257, "c")}}}},
       "structured_outputs.choice", "--max-guided-choices"},
  };
  for (const auto& k : cases) {
    Reply r = post(s(), "/v1/completions", k.body);
    EXPECT_EQ(r.status, 400) << k.message;
    ASSERT_TRUE(r.body.contains("error")) << r.body;
    EXPECT_EQ(r.body["error"]["param"], k.param);
    EXPECT_NE(r.body["error"]["message"].get<std::string>().find(k.message), std::string::npos) << r.body;
  }
  expect_serving();
}

// Bodies that could never be served are refused while they are read, before
// they become a JSON tree or a token list: an array longer than any servable
// one (max(max_model_len, 4096) elements), a text longer than the context can
// hold whatever it encodes to.
TEST_F(ReliabilityTest, HugeArraysAndTextsAreRefusedBeforeTheyCostMemory) {
  std::string ids = "[";
  for (int i = 0; i < 5000; ++i) ids += i ? ",5" : "5";
  ids += "]";
  Reply r = post(s(), "/v1/completions", R"({"prompt": )" + ids + "}");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.dump().find("more than 4096 elements"), std::string::npos) << r.body;
  std::string members = "{";
  for (int i = 0; i < 5000; ++i) members += (i ? ",\"k" : "\"k") + std::to_string(i) + "\": 1";
  r = post(s(), "/v1/completions", R"({"prompt": "x", "logit_bias": )" + members + "}}");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.dump().find("more than 4096 elements"), std::string::npos) << r.body;
  // The message is the before-encoding refusal's (after encoding, the
  // refusal would count the prompt's tokens).
  r = post(s(), "/v1/completions", json{{"prompt", std::string(900000, 'a')}, {"max_tokens", 1}});
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.body["error"]["param"], "prompt");
  EXPECT_NE(r.body.dump().find("encode to more than"), std::string::npos) << r.body;
  r = post(s(), "/v1/chat/completions",
           json{{"messages", {{{"role", "user"}, {"content", std::string(900000, 'a')}}}}, {"max_tokens", 1}});
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.body["error"]["param"], "messages");
  expect_serving();
}

// Found by a review as a user would: each a real request that went wrong.
TEST_F(ReliabilityTest, ReviewFindings) {
  // 4096 arrays of 4096 empty arrays: each array under the element limit,
  // together 16 M values (a 48 MiB body that grew the server by ~1 GB).
  std::string many = R"({"prompt": "a", "max_tokens": 1, "x": [)";
  for (int i = 0; i < 700; ++i) {
    many += i ? ",[" : "[";
    for (int j = 0; j < 4000; ++j) many += j ? ",[]" : "[]";
    many += "]";
  }
  many += "]}";
  ASSERT_LT(many.size(), 1u << 24);
  ServerProcess big;  // default limits: the suite's server takes 1 MiB bodies
  ASSERT_TRUE(big.ready()) << big.log();
  Reply r = post(big, "/v1/completions", many);
  EXPECT_EQ(r.status, 400) << r.raw.substr(0, 300);
  EXPECT_NE(r.raw.find("--max-json-values"), std::string::npos) << r.raw.substr(0, 300);
  // Headers over --max-header-bytes (8192 here) in many small lines.
  std::string headers;
  for (int i = 0; i < 200; ++i) headers += "X-H" + std::to_string(i) + ": " + std::string(40, 'v') + "\r\n";
  EXPECT_EQ(raw(request("GET", "/health", "", headers)).status, 431);
  // Empty lines before a request line are skipped.
  EXPECT_EQ(raw("\r\n\r\n" + request("GET", "/health", "")).status, 200);
  // A transfer coding other than chunked is refused, not ignored.
  EXPECT_EQ(raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n")
                .status,
            501);
  // A client that half-closes after its request gets no made-up 500.
  {
    RawConn c(s().port());
    ASSERT_TRUE(c.send(request("POST", "/v1/completions",
                               json{{"prompt", "x"}, {"max_tokens", 200}, {"ignore_eos", true}}.dump())));
    ::shutdown(c.fd(), SHUT_WR);
    auto resp = c.read_response(5);
    EXPECT_NE(resp.status, 500) << resp.body;
  }
  // top_p that is > 0 as a double but 0 as the sampler's float.
  r = post(s(), "/v1/completions", json{{"prompt", "x"}, {"top_p", 1e-300}});
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.body["error"]["param"], "top_p");
  // An id past 2^63 is named as sent.
  r = post(s(), "/v1/completions", std::string(R"({"prompt": [18446744073709551615]})"));
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.raw.find("18446744073709551615"), std::string::npos) << r.raw;
  // A chat prompt past the context names 'messages', the field it came from.
  std::string words;
  for (int i = 0; i < 1100; ++i) words += " hello";
  r = post(s(), "/v1/chat/completions", json{{"messages", {{{"role", "user"}, {"content", words}}}}});
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.body["error"]["param"], "messages") << r.raw;
  expect_serving();
}

TEST_F(ReliabilityTest, MemoryIsReturnedAfterLargeRequests) {
  expect_serving();
  const int64_t before = rss_bytes(s().pid());
  ASSERT_GT(before, 0);
  // ~1 MiB bodies of 256 prompts of 1,000 token ids (refused: one too many
  // choices) and of one long string, each parsed into JSON values several
  // times its size.
  std::string ids = "[";
  for (int p = 0; p < 257; ++p) {
    ids += p ? ",[" : "[";
    for (int i = 0; i < 1000; ++i) ids += i ? ",5" : "5";
    ids += "]";
  }
  ids += "]";
  ASSERT_LT(ids.size(), 1u << 20);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(post(s(), "/v1/completions", R"({"prompt": )" + ids + "}").status, 400);
    EXPECT_EQ(post(s(), "/v1/completions", json{{"prompt", std::string(1000000, 'a')}, {"max_tokens", 1}}).status,
              400);
  }
  expect_serving();
  const int64_t after = rss_bytes(s().pid());
  EXPECT_LT(after - before, 64 << 20) << "RSS " << before << " -> " << after;
}

// A checkpoint whose embedding is padded past its tokenizer (as DeepSeek-V3's
// 129,280 rows against 128,815 tokens): the tiny tokenizer's 4,096 tokens
// against 65,536 rows of dummy weights.
TEST(VocabGapTest, GapIdsAreRefusedInPromptsAndDecodeToNothingWhenSampled) {
  ServerProcess srv({"--load-format", "dummy", "--override", "vocab_size=65536"});
  ASSERT_TRUE(srv.ready()) << srv.log();
  Reply r = post(srv, "/v1/completions", json{{"prompt", json::array({1, 5000})}, {"max_tokens", 1}});
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.dump().find("5000"), std::string::npos) << r.body;
  EXPECT_NE(r.body.dump().find("vocabulary"), std::string::npos) << r.body;
  // Near-uniform sampling over 65,536 ids lands in the gap ~94% of the time.
  for (bool stream : {false, true}) {
    json body = {{"prompt", "def f"}, {"max_tokens", 64}, {"temperature", 1000}, {"ignore_eos", true},
                 {"seed", 7},        {"logprobs", 2},     {"stream", stream}};
    auto res = srv.client().Post("/v1/completions", body.dump(), "application/json");
    ASSERT_TRUE(res) << "server gone:\n" << srv.log();
    EXPECT_EQ(res->status, 200) << res->body;
    if (!stream) {  // the gap was sampled: tokens with no text
      const json reply = json::parse(res->body);
      int empty = 0;
      for (const auto& t : reply["choices"][0]["logprobs"]["tokens"]) empty += t.get<std::string>().empty();
      EXPECT_GT(empty, 32) << res->body;
    }
  }
  Reply chat = post(srv, "/v1/chat/completions",
                    json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 32}, {"temperature", 1000}});
  EXPECT_EQ(chat.status, 200) << chat.body;
  EXPECT_EQ(srv.client().Get("/health")->status, 200);
}

}  // namespace
}  // namespace nucleus
