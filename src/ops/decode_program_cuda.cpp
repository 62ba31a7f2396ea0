#include "ops/decode_program_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>

#include "core/cuda/context.h"
#include "core/knobs.h"
#include "core/device.h"
#include "kernels/common/device_sms.h"
#include "kernels/mono/mono_kernel.cuh"
#include "kernels/mono/mono_program_ref.h"
#include "ops/skinny.h"

namespace nucleus::cuda_ops {

namespace mono = kernels::mono;

void DecodeProgramRunner::reserve(const MakeStages& make) {
  num_ctas_ = kernels::current_device_sms();
  lean_ = env_flag(Knob::kDecodeProgramLean);  // NUCLEUS_DECODE_PROGRAM_LEAN: the smallest build a program needs
  release_ = env_flag(Knob::kDecodeProgramRelease);  // NUCLEUS_DECODE_PROGRAM_RELEASE: release/acquire counters
  counters_ = Tensor::empty({mono::kMaxStages + 1}, DType::kI32, Device::kCuda);
  zero_device(counters_);
  for (int i = 0; i < kNumWidths; ++i) {
    const mono::ProgramPlan plan = mono::deal_jobs(make(kWidths[i]), kWidths[i], num_ctas_);
    queue_start_[i] = Tensor::empty({static_cast<int64_t>(plan.queue_start.size())}, DType::kI32, Device::kCuda);
    copy_to_device(queue_start_[i].raw(), plan.queue_start.data(), plan.queue_start.size() * sizeof(int32_t));
    jobs_[i] = Tensor::empty({static_cast<int64_t>(std::max<size_t>(1, plan.jobs.size()) * 2)}, DType::kI32,
                             Device::kCuda);
    copy_to_device(jobs_[i].raw(), plan.jobs.data(), plan.jobs.size() * sizeof(mono::Job));
    for (const mono::Stage& st : plan.stages) dealt_jobs_[i].push_back(mono::stage_jobs(st));
  }
}

bool DecodeProgramRunner::launch(OpContext& ctx, int64_t rows, const std::vector<const void*>& buffers,
                                 const MakeStages& make, const std::string& where) {
  int wi = 0;
  while (kWidths[wi] < rows) ++wi;
  const int32_t width = kWidths[wi];
  std::vector<const void*> key = buffers;
  key.push_back(reinterpret_cast<const void*>(rows));
  auto it = checked_[wi].find(key);
  if (it == checked_[wi].end()) {
    // Eager steps whose keys keep changing (an attending front's max_blocks_per_seq grows with the sequences)
    // must not grow the cache without bound: start it over (a check is host work only).
    if (checked_[wi].size() >= kMaxChecked) checked_[wi].clear();
    // Checked over the step's rows: the graph's buffers may hold fewer rows than the width.
    auto checked = mono::check_program(make(width), width, static_cast<int32_t>(rows));
    if (!checked.ok()) {
      ctx.fail(checked.status().with_context(where));
      return false;
    }
    std::vector<int32_t> jobs;
    for (const mono::Stage& st : *checked) jobs.push_back(mono::stage_jobs(st));
    if (jobs != dealt_jobs_[wi]) {
      ctx.fail(internal_error(where + ": the stages differ from those the job queues were dealt for"));
      return false;
    }
    it = checked_[wi].emplace(key, std::move(*checked)).first;
  }
  mono::Program prog;
  for (size_t i = 0; i < it->second.size(); ++i) prog.stages[i] = it->second[i];
  prog.num_stages = static_cast<int32_t>(it->second.size());
  prog.width = width;
  prog.rows = static_cast<int32_t>(rows);
  prog.num_ctas = num_ctas_;
  prog.queue_start = queue_start_[wi].data<int32_t>();
  prog.jobs = static_cast<const mono::Job*>(jobs_[wi].raw());
  prog.counters = counters_.data<int32_t>();
  prog.lean = lean_;
  prog.release_counters = release_;
  const cudaError_t e = mono::launch_mono_program(prog, cuda::context().stream, skinny_pdl());
  if (e != cudaSuccess) {
    ctx.fail(internal_error(where + ": " + cudaGetErrorString(e)));
    return false;
  }
  return true;
}

}  // namespace nucleus::cuda_ops
