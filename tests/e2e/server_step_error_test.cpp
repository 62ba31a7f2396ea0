// `nucleus serve` with a failing step (NUCLEUS_FAULT_INJECT, test only): the
// request of the failed step gets a 500 error body (non-streaming) or an
// error finish and error event (streaming), the server then answers the
// same request exactly as without the fault and holds no KV block; a fatal
// fault answers 503 and the server drains and exits 1, saying why.
#include "server_util.h"

namespace nucleus {
namespace {

using nlohmann::json;
using namespace nucleus::testing;

// `nucleus serve --device cpu` on tiny-dsv3 with NUCLEUS_FAULT_INJECT=fault.
struct Server : ServerProcess {
  explicit Server(const std::string& fault) : ServerProcess({}, {"NUCLEUS_FAULT_INJECT=" + fault}) {}
};

Reply post(const Server& s, const json& body) { return testing::post(s, "/v1/completions", body); }

json ref_case() {
  std::ifstream in(testing::model_path("ref/cases.json"));
  return json::parse(in)["tiny-dsv3"][0];
}

json request(bool stream) {
  const json c = ref_case();
  return {{"prompt", c["prompt"]}, {"max_tokens", 32}, {"temperature", 0}, {"ignore_eos", true}, {"stream", stream}};
}

double kv_blocks_used(const Server& s) {
  auto res = s.client().Get("/metrics");
  if (!res) return -1;
  std::stringstream ss(res->body);
  std::string line;
  while (std::getline(ss, line))
    if (line.rfind("nucleus_kv_blocks_used ", 0) == 0) return std::stod(line.substr(23));
  return -1;
}

TEST(ServerStepErrorTest, FailedStepIs500ThenTheSameRequestSucceeds) {
  Server s("embedding:2");  // the first request's first decode step
  ASSERT_TRUE(s.ready()) << s.log();
  Reply r = post(s, request(false));
  ASSERT_EQ(r.status, 500) << r.raw;
  EXPECT_EQ(r.body["error"]["type"], "internal_error") << r.raw;
  const std::string msg = r.body["error"]["message"].get<std::string>();
  EXPECT_NE(msg.find("injected fault in op embedding"), std::string::npos) << msg;
  EXPECT_EQ(kv_blocks_used(s), 0);
  auto health = s.client().Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  r = post(s, request(false));
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["choices"][0]["text"], ref_case()["greedy_text"]);
  EXPECT_EQ(r.body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(kv_blocks_used(s), 0);
  EXPECT_NE(s.log().find("step 2 failed"), std::string::npos) << s.log();
}

TEST(ServerStepErrorTest, FailedStepEndsAStreamWithAnErrorEvent) {
  Server s("embedding:3");
  ASSERT_TRUE(s.ready()) << s.log();
  auto res = s.client().Post("/v1/completions", request(true).dump(), "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);  // the stream had begun
  std::vector<json> events;
  bool done = false;
  std::stringstream ss(res->body);
  std::string line;
  while (std::getline(ss, line)) {
    if (line.rfind("data: ", 0) != 0) continue;
    if (line == "data: [DONE]")
      done = true;
    else
      events.push_back(json::parse(line.substr(6)));
  }
  EXPECT_TRUE(done) << res->body;
  ASSERT_GE(events.size(), 2u) << res->body;
  const json& finish = events[events.size() - 2];
  ASSERT_TRUE(finish.contains("choices")) << res->body;
  EXPECT_EQ(finish["choices"][0]["finish_reason"], "error") << res->body;
  const json& error = events.back();
  ASSERT_TRUE(error.contains("error")) << res->body;
  EXPECT_EQ(error["error"]["type"], "internal_error");
  EXPECT_NE(error["error"]["message"].get<std::string>().find("injected fault in op embedding"), std::string::npos);
  EXPECT_EQ(kv_blocks_used(s), 0);
  Reply r = post(s, request(false));
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["choices"][0]["text"], ref_case()["greedy_text"]);
}

TEST(ServerStepErrorTest, FatalFaultIs503AndTheServerExitsOne) {
  Server s("embedding:2:fatal");
  ASSERT_TRUE(s.ready()) << s.log();
  Reply r = post(s, request(false));
  ASSERT_EQ(r.status, 503) << r.raw;
  EXPECT_EQ(r.body["error"]["type"], "service_unavailable") << r.raw;
  EXPECT_NE(r.body["error"]["message"].get<std::string>().find("injected fault"), std::string::npos) << r.raw;
  // Later requests are refused while it drains (or find it gone).
  Reply later = post(s, request(false));
  EXPECT_TRUE(later.status == 503 || later.status == 0) << later.raw;
  EXPECT_EQ(s.exit_status(30), 1) << s.log();
  const std::string log = s.log();
  EXPECT_NE(log.find("the engine failed, shutting the server down"), std::string::npos) << log;
  EXPECT_NE(log.find("server stopped: the engine failed"), std::string::npos) << log;
}

}  // namespace
}  // namespace nucleus
