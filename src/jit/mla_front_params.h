// Parameters of the MLA decode front-end kernels (mla_front_kernel.cuh),
// shared by the host and the NVRTC-compiled source: plain C, no includes.
// bf16 tensors are passed as unsigned short (the bits of a bfloat16).
//
// Shapes (W = rows of the step, <= the build's width; H = hidden_size;
// Q = q_lora_rank; N = num_heads; the MLA widths are fixed at DeepSeek's:
// kv_lora 512, qk_rope 64, qk_nope 128, so a cache row is 576 wide):
#ifndef NUCLEUS_MLA_FRONT_PARAMS_H_
#define NUCLEUS_MLA_FRONT_PARAMS_H_

struct MlaFrontParams {
  const unsigned short* x;          // [W, H] bf16, row stride x_stride: the input RMSNorm's output
  long long x_stride;               // elements, a multiple of 8
  const unsigned short* w_qa;       // [Q, H] bf16: q_a_proj.weight (unused when Q = 0)
  const float* qa_norm_w;           // [Q] f32: q_a_layernorm.weight (unused when Q = 0)
  const unsigned short* w_qb;       // [N * 192, Q] bf16: q_b_proj.weight; when Q = 0 (no q LoRA,
                                    // DeepSeek-V2-Lite) [N * 192, H]: q_proj.weight
  const unsigned short* w_kva;      // [576, H] bf16: kv_a_proj_with_mqa.weight
  const float* kva_norm_w;          // [512] f32: kv_a_layernorm.weight
  const unsigned short* w_kvb;      // [N * 256, 512] bf16: kv_b_proj.weight (W_UK = rows h*256 .. h*256+127)
  const int* positions;             // [W]
  const long long* slot_mapping;    // [W]; -1 writes no cache row (pad rows)
  const float* inv_freq;            // [32] f32: RoPE inverse frequencies
  float attention_factor;           // YaRN cos/sin multiplier
  float eps;                        // RMSNorm epsilon (both norms)
  unsigned short* cache;            // this layer's latent cache [num_slots, 576] bf16
  unsigned short* q_a;              // scratch [W, Q] bf16: q_a_proj, then normalised in place (unused when Q = 0)
  unsigned short* kv_a;             // scratch [W, 576] bf16: kv_a_proj, c_kv normalised in place
  unsigned short* q;                // out [W, N * 192] bf16: q_b_proj, q_pe rotated in place
  unsigned short* q_full;           // out [W, N, 576] bf16: [q_nope . W_UK (512) | rotated q_pe (64)]
  unsigned int* barrier;            // [2] zero before the first launch; left zero by every launch
  int rows;                         // W, 0 .. the build's width
  int hidden;                       // H, a multiple of 8
  int q_lora;                       // Q, a multiple of 8, <= 8192; 0: no q LoRA (q_proj in w_qb)
  int num_heads;                    // N
};

#endif  // NUCLEUS_MLA_FRONT_PARAMS_H_
