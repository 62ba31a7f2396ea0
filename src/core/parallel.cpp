#include "core/parallel.h"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "core/knobs.h"

namespace nucleus {

int cpu_threads() {
  static const int n = [] {
    if (auto env = env_string(Knob::kCpuThreads)) {
      const char* e = env->c_str();
      const auto v = parse_int(*env);
      if (v && *v > 0 && *v <= 4096) return static_cast<int>(*v);
      std::fprintf(stderr, "warning: NUCLEUS_CPU_THREADS='%s' is not an integer in 1..4096; using the core count\n", e);
    }
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return n;
}

namespace {

// A persistent pool: worker i runs chunk i of the current job.
class Pool {
 public:
  explicit Pool(int workers) {
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this, i] { loop(i); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int workers() const { return static_cast<int>(threads_.size()); }

  // Runs job(i) for i in [0, count) with count <= workers() + 1; the caller
  // runs index 0.
  void run(int count, const std::function<void(int)>& job) {
    std::unique_lock<std::mutex> caller(run_mu_);  // one job at a time
    {
      std::lock_guard<std::mutex> l(mu_);
      job_ = &job;
      count_ = count;
      pending_ = count - 1;
      ++generation_;
    }
    cv_.notify_all();
    job(0);
    std::unique_lock<std::mutex> l(mu_);
    done_cv_.wait(l, [&] { return pending_ == 0; });
    job_ = nullptr;
  }

 private:
  void loop(int worker) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* job;
      int index = worker + 1;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (index >= count_) continue;
        job = job_;
      }
      (*job)(index);
      {
        std::lock_guard<std::mutex> l(mu_);
        if (--pending_ == 0) done_cv_.notify_all();
      }
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_, run_mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  int count_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

Pool& pool() {
  static Pool p(cpu_threads() - 1);
  return p;
}

thread_local bool t_in_parallel = false;

}  // namespace

void parallel_for(int64_t total, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (total <= 0) return;
  int64_t max_chunks = std::max<int64_t>(1, total / std::max<int64_t>(1, grain));
  int chunks = static_cast<int>(std::min<int64_t>(max_chunks, cpu_threads()));
  if (chunks <= 1 || t_in_parallel) {
    fn(0, total);
    return;
  }
  int64_t per = (total + chunks - 1) / chunks;
  pool().run(chunks, [&](int i) {
    t_in_parallel = true;
    int64_t b = i * per, e = std::min(total, b + per);
    if (b < e) fn(b, e);
    t_in_parallel = false;
  });
}

}  // namespace nucleus
