// Value checks of checkpoint tensors at load: a NaN or an infinity in one
// weight turns every logit into NaN (or garbage) at the first step that
// reads it, far from its cause; a scan of the raw bytes at load names it.
// Cost: one read of each byte, parallel over NUCLEUS_CPU_THREADS, next to the
// conversion that reads it anyway (--skip-weight-check skips it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "core/tensor.h"
#include "model/tp_shard.h"

namespace nucleus {

// What makes an element of a tensor unusable.
enum class ValueCheck {
  kFinite,      // F32 / BF16 / F16: NaN or +-Inf; F8_E4M3 (e4m3fn): a NaN byte, 0x7f or 0xff
  kBlockScale,  // an FP8 weight_scale_inv: F32 not finite or <= 0 (-0 included); U8 (E8M0): 0xff, NaN
};

// Index of the first element among data[0, count) (dtype `dtype`, contiguous)
// that `check` refuses, or -1 when there is none (also for dtypes the check
// does not cover, such as I32). Parallel over chunks (core/parallel.h); the
// answer is the lowest bad index whatever the thread count.
int64_t first_bad_value(const void* data, DType dtype, int64_t count, ValueCheck check);

// The element's raw value for an error message: "nan", "inf", "-0.5", or the
// byte "0x7f" (F8_E4M3 / U8).
std::string describe_value(const void* data, DType dtype, int64_t index);

// `flat` as coordinates of `shape` (row-major): "[3, 17]"; "[5]" for 1-D.
std::string index_to_string(const std::vector<int64_t>& shape, int64_t flat);

// Checks `t`, all of checkpoint tensor `name` (in `file`, shape `full_shape`)
// or, under tensor parallelism, its rows (split kRows) or columns (kCols)
// from `begin` on. kDataLoss naming the file, the tensor, the first bad
// element's index in the full tensor and its value.
Status check_tensor_values(const std::string& file, const std::string& name, const Tensor& t, ValueCheck check,
                           const std::vector<int64_t>& full_shape, ShardSplit split = ShardSplit::kReplicated,
                           int64_t begin = 0);

}  // namespace nucleus
