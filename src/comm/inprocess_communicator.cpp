#include "comm/inprocess_communicator.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "core/check.h"

namespace nucleus {

namespace {

// What the ranks of one group share: a barrier that can be aborted, every
// rank's buffer for the collective in flight, and the reduction buffer.
class SharedState {
 public:
  explicit SharedState(int world_size) : world_size_(world_size), buffers_(world_size), counts_(world_size) {}

  int world_size() const { return world_size_; }

  // Waits until every rank arrived (or the group was aborted).
  Status barrier() {
    std::unique_lock<std::mutex> lock(mu_);
    if (aborted_) return aborted(abort_reason_);
    const uint64_t generation = generation_;
    if (++arrived_ == world_size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return ok_status();
    }
    cv_.wait(lock, [&] { return generation_ != generation || aborted_; });
    if (generation_ != generation) return ok_status();
    return aborted(abort_reason_);
  }

  void abort(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_) abort_reason_ = "tensor-parallel group aborted: " + why;
    aborted_ = true;
    cv_.notify_all();
  }

  // Publishes rank's buffer for the collective in flight (before the first
  // barrier) and sizes the reduction buffer.
  void publish(int rank, const void* buf, int64_t count, int64_t reduce_floats) {
    std::lock_guard<std::mutex> lock(mu_);
    buffers_[rank] = buf;
    counts_[rank] = count;
    if (static_cast<int64_t>(reduce_.size()) < reduce_floats) reduce_.resize(reduce_floats);
  }
  // After the first barrier: every rank's buffer; counts checked equal.
  const void* buffer(int rank) const { return buffers_[rank]; }
  void check_counts(const char* what) const {
    for (int r = 1; r < world_size_; ++r)
      NUCLEUS_CHECK(counts_[r] == counts_[0], "{}: rank {} passed {} elements, rank 0 {}", what, r, counts_[r],
                    counts_[0]);
  }
  float* reduce_buffer() { return reduce_.data(); }

 private:
  const int world_size_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string abort_reason_;
  std::vector<const void*> buffers_;
  std::vector<int64_t> counts_;
  std::vector<float> reduce_;
};

float load(const void* p, DType dtype, int64_t i) {
  return dtype == DType::kF32 ? static_cast<const float*>(p)[i] : bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
}

class InProcessCommunicator : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<SharedState> state, int rank) : state_(std::move(state)), rank_(rank) {}

  int rank() const override { return rank_; }
  int world_size() const override { return state_->world_size(); }
  Device device() const override { return Device::kCpu; }
  const char* backend() const override { return "inprocess"; }

  Status all_reduce_sum(const void* send, void* recv, int64_t count, DType dtype, void*) override {
    if (dtype != DType::kF32 && dtype != DType::kBF16)
      return unsupported(std::string("in-process all-reduce of ") + dtype_name(dtype) + " (F32 and BF16 only)");
    const int world = world_size();
    state_->publish(rank_, send, count, count);
    NUCLEUS_RETURN_IF_ERROR(state_->barrier());
    state_->check_counts("all_reduce_sum");
    // Reduce-scatter: this rank's slice of the elements, summed in rank order.
    const int64_t per = (count + world - 1) / world;
    const int64_t begin = std::min(count, rank_ * per), end = std::min(count, begin + per);
    float* sum = state_->reduce_buffer();
    for (int64_t i = begin; i < end; ++i) {
      float s = 0.0f;
      for (int r = 0; r < world; ++r) s += load(state_->buffer(r), dtype, i);
      sum[i] = s;
    }
    NUCLEUS_RETURN_IF_ERROR(state_->barrier());
    // All-gather: every rank copies the whole sum.
    if (dtype == DType::kF32) {
      std::memcpy(recv, sum, count * sizeof(float));
    } else {
      auto* out = static_cast<uint16_t*>(recv);
      for (int64_t i = 0; i < count; ++i) out[i] = f32_to_bf16(sum[i]);
    }
    return state_->barrier();  // the sum and the buffers stay until every rank has copied
  }

  Status all_gather(const void* send, void* recv, int64_t count, DType dtype, void*) override {
    const size_t bytes = static_cast<size_t>(count) * dtype_size(dtype);
    state_->publish(rank_, send, count, 0);
    NUCLEUS_RETURN_IF_ERROR(state_->barrier());
    state_->check_counts("all_gather");
    for (int r = 0; r < world_size(); ++r)
      if (bytes) std::memcpy(static_cast<char*>(recv) + r * bytes, state_->buffer(r), bytes);
    return state_->barrier();
  }

  Status broadcast(void* buf, int64_t count, DType dtype, int root, void*) override {
    if (root < 0 || root >= world_size())
      return invalid_argument("broadcast root " + std::to_string(root) + " outside [0, " +
                              std::to_string(world_size()) + ")");
    state_->publish(rank_, buf, count, 0);
    NUCLEUS_RETURN_IF_ERROR(state_->barrier());
    state_->check_counts("broadcast");
    const size_t bytes = static_cast<size_t>(count) * dtype_size(dtype);
    if (rank_ != root && bytes) std::memcpy(buf, state_->buffer(root), bytes);
    return state_->barrier();
  }

  void abort(const std::string& why) override { state_->abort(why); }

 private:
  std::shared_ptr<SharedState> state_;
  int rank_;
};

}  // namespace

StatusOr<std::vector<std::unique_ptr<Communicator>>> make_inprocess_communicators(int world_size) {
  if (world_size < 1) return invalid_argument("tensor-parallel size must be >= 1, got " + std::to_string(world_size));
  auto state = std::make_shared<SharedState>(world_size);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < world_size; ++r) out.push_back(std::make_unique<InProcessCommunicator>(state, r));
  return out;
}

}  // namespace nucleus
