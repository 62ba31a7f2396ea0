// The fp8_ds_mla latent-cache row (the layout of FlashMLA's FP8 sparse decode
// and DeepSeek-V3.2; vLLM's --kv-cache-dtype fp8_ds_mla): one token's
// kv_lora = 512 latent values and qk_rope = 64 rope values in 656 bytes,
//   bytes [0, 512)    e4m3(c_kv[i] / scale[i / 128])      the latent, 4 tiles of 128
//   bytes [512, 528)  scale[0..3] as f32 (little endian)  one scale per tile
//   bytes [528, 656)  bf16(k_pe[j])                       the rope part, unscaled
// with, per tile t, amax_t = max |c_kv[i]| over the tile's finite values and
//   scale[t] = amax_t / 448                               (f32 division)
//   stored   = e4m3(x / scale[t])  round to nearest even, saturating at +-448
//              (the division in f32); a tile whose finite values are all 0
//              has scale 0 and stores e4m3(x) instead (0 for finite x)
//   read     = f32(stored) * scale[t]
// Non-finite latent values are handled the same on CPU and CUDA: they do not
// enter amax, +-inf saturates (stores +-448, reads +-448 * scale[t]), NaN
// stores an e4m3 NaN and reads NaN. The rope part rounds to bf16 (nearest
// even). Header usable from CUDA code (constants only besides the CPU reference).
#pragma once

#include <cstdint>

namespace nucleus::kernels {

inline constexpr int kDsMlaLatent = 512;                           // e4m3 latent values a row
inline constexpr int kDsMlaRope = 64;                              // bf16 rope values a row
inline constexpr int kDsMlaTile = 128;                             // latent values per f32 scale
inline constexpr int kDsMlaScales = kDsMlaLatent / kDsMlaTile;     // 4
inline constexpr int kDsMlaScaleOffset = kDsMlaLatent;             // byte offset of the scales: 512
inline constexpr int kDsMlaRopeOffset = kDsMlaLatent + 4 * kDsMlaScales;  // byte offset of the rope: 528
inline constexpr int kDsMlaRowBytes = kDsMlaRopeOffset + 2 * kDsMlaRope;  // 656

// CPU reference. src: kDsMlaLatent + kDsMlaRope (576) f32 values [c_kv | k_pe];
// dst: kDsMlaRowBytes bytes.
void encode_ds_mla_row_ref(const float* src, uint8_t* dst);
// CPU reference. src: kDsMlaRowBytes bytes; dst: 576 f32 values [c_kv | k_pe].
void decode_ds_mla_row_ref(const uint8_t* src, float* dst);

}  // namespace nucleus::kernels
