#include "server/async_engine.h"

#include <chrono>

namespace nucleus::server {

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void OutputQueue::push(OutputEvent e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(e));
  }
  cv_.notify_one();
}

std::vector<OutputEvent> OutputQueue::pop_all() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !events_.empty(); });
  std::vector<OutputEvent> out(std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
  events_.clear();
  return out;
}

std::vector<OutputEvent> OutputQueue::pop_all_for(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return !events_.empty(); });
  std::vector<OutputEvent> out(std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
  events_.clear();
  return out;
}

AsyncEngine::AsyncEngine(std::unique_ptr<LLMEngine> engine)
    : engine_(std::move(engine)),
      config_(engine_->config()),
      vocab_size_(engine_->model().config().vocab_size),
      stats_(engine_->stats()) {
  thread_ = std::thread([this] { loop(); });
}

AsyncEngine::~AsyncEngine() { shutdown(); }

void AsyncEngine::submit(std::vector<EngineRequest> requests, std::shared_ptr<OutputQueue> queue) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_) {
      num_live_ += static_cast<int64_t>(requests.size());
      inbox_.push_back({std::move(requests), std::move(queue)});
      wake_.notify_one();
      return;
    }
  }
  for (const auto& r : requests) {
    OutputEvent e;
    e.kind = OutputEvent::Kind::kRejected;
    e.index = r.index;
    e.error = aborted("the server is shutting down");
    e.time = steady_seconds();
    queue->push(std::move(e));
  }
}

void AsyncEngine::abort(const std::string& request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  aborts_.push_back(request_id);
  wake_.notify_one();
}

void AsyncEngine::abort_all() {
  std::lock_guard<std::mutex> lock(mu_);
  abort_all_ = true;
  wake_.notify_one();
}

bool AsyncEngine::wait_idle(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  return idle_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return num_live_ == 0; });
}

EngineStats AsyncEngine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

Status AsyncEngine::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void AsyncEngine::on_failure(std::function<void(const Status&)> fn) {
  Status failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.ok()) {
      on_failure_ = std::move(fn);
      return;
    }
    failed = failure_;
  }
  fn(failed);
}

void AsyncEngine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    wake_.notify_one();
  }
  if (thread_.joinable()) thread_.join();
}

void AsyncEngine::admit(Pending& p) {
  for (auto& r : p.requests) {
    OutputEvent e;
    e.index = r.index;
    Status s = engine_->add_request(r.request_id, std::move(r.prompt_token_ids), r.params);
    e.time = steady_seconds();
    if (s.ok()) {
      e.kind = OutputEvent::Kind::kAdmitted;
      live_[r.request_id] = Live{r.index, p.queue};
    } else {
      e.kind = OutputEvent::Kind::kRejected;
      e.error = s;
      std::lock_guard<std::mutex> lock(mu_);
      --num_live_;
    }
    p.queue->push(std::move(e));
  }
}

void AsyncEngine::do_abort(const std::string& request_id) {
  auto it = live_.find(request_id);
  if (it == live_.end()) return;  // finished already, or never admitted
  engine_->abort(request_id);
  OutputEvent e;
  e.index = it->second.index;
  e.output.request_id = request_id;
  e.output.finished = true;
  e.output.finish_reason = FinishReason::kAbort;
  e.time = steady_seconds();
  it->second.queue->push(std::move(e));
  live_.erase(it);
  std::lock_guard<std::mutex> lock(mu_);
  --num_live_;
}

void AsyncEngine::route(std::vector<RequestOutput>& outputs) {
  const double now = steady_seconds();
  int64_t finished = 0;
  for (auto& o : outputs) {
    auto it = live_.find(o.request_id);
    if (it == live_.end()) continue;
    OutputEvent e;
    e.index = it->second.index;
    e.time = now;
    const bool done = o.finished;
    e.output = std::move(o);
    it->second.queue->push(std::move(e));
    if (done) {
      live_.erase(it);
      ++finished;
    }
  }
  if (finished) {
    std::lock_guard<std::mutex> lock(mu_);
    num_live_ -= finished;
  }
}

void AsyncEngine::loop() {
  for (;;) {
    std::vector<Pending> inbox;
    std::vector<std::string> aborts;
    bool all = false, stop = false;
    const bool busy = engine_->has_unfinished();
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return busy || stop_ || abort_all_ || !inbox_.empty() || !aborts_.empty(); });
      inbox.swap(inbox_);
      aborts.swap(aborts_);
      all = abort_all_ || stop_;
      abort_all_ = false;
      stop = stop_;
    }
    if (stop) {
      // Refuse what was queued, abort what runs: every queue hears its end.
      for (auto& p : inbox)
        for (auto& r : p.requests) {
          OutputEvent e;
          e.kind = OutputEvent::Kind::kRejected;
          e.index = r.index;
          e.error = aborted("the server is shutting down");
          e.time = steady_seconds();
          p.queue->push(std::move(e));
          std::lock_guard<std::mutex> lock(mu_);
          --num_live_;
        }
      inbox.clear();
    }
    for (auto& p : inbox) admit(p);
    for (const auto& id : aborts) do_abort(id);
    if (all) {
      std::vector<std::string> ids;
      for (const auto& [id, live] : live_) ids.push_back(id);
      for (const auto& id : ids) do_abort(id);
    }
    std::vector<RequestOutput> outputs;
    if (!stop && engine_->has_unfinished()) outputs = engine_->step();
    std::function<void(const Status&)> failed;
    {
      // Stats first: a client that got its last token and then reads
      // /metrics sees the engine as of that step (its blocks freed).
      std::lock_guard<std::mutex> lock(mu_);
      stats_ = engine_->stats();
      if (failure_.ok() && !engine_->failure().ok()) {
        failure_ = engine_->failure();
        failed = std::move(on_failure_);
      }
    }
    route(outputs);
    if (failed) failed(engine_->failure());
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (num_live_ == 0) idle_.notify_all();
    }
    if (stop) return;
  }
}

}  // namespace nucleus::server
