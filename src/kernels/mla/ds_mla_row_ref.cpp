#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "kernels/mla/ds_mla_row.h"

namespace nucleus::kernels {

void encode_ds_mla_row_ref(const float* src, uint8_t* dst) {
  for (int t = 0; t < kDsMlaScales; ++t) {
    const float* x = src + t * kDsMlaTile;
    float amax = 0.0f;
    for (int i = 0; i < kDsMlaTile; ++i)
      if (std::isfinite(x[i])) amax = std::max(amax, std::fabs(x[i]));
    const float scale = amax / kFp8E4M3Max;
    for (int i = 0; i < kDsMlaTile; ++i) dst[t * kDsMlaTile + i] = f32_to_fp8e4m3(scale > 0.0f ? x[i] / scale : x[i]);
    std::memcpy(dst + kDsMlaScaleOffset + 4 * t, &scale, 4);
  }
  for (int j = 0; j < kDsMlaRope; ++j) {
    const uint16_t h = f32_to_bf16(src[kDsMlaLatent + j]);
    std::memcpy(dst + kDsMlaRopeOffset + 2 * j, &h, 2);
  }
}

void decode_ds_mla_row_ref(const uint8_t* src, float* dst) {
  for (int t = 0; t < kDsMlaScales; ++t) {
    float scale;
    std::memcpy(&scale, src + kDsMlaScaleOffset + 4 * t, 4);
    for (int i = 0; i < kDsMlaTile; ++i) dst[t * kDsMlaTile + i] = fp8e4m3_to_f32(src[t * kDsMlaTile + i]) * scale;
  }
  for (int j = 0; j < kDsMlaRope; ++j) {
    uint16_t h;
    std::memcpy(&h, src + kDsMlaRopeOffset + 2 * j, 2);
    dst[kDsMlaLatent + j] = bf16_to_f32(h);
  }
}

}  // namespace nucleus::kernels
