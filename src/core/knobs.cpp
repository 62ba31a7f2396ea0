#include "core/knobs.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "core/check.h"

extern char** environ;  // POSIX: the process environment

namespace nucleus {

namespace {

// KNOB(kX): the enumerator and its spelling (KnobInfo::knob, KnobInfo::id).
#define KNOB(id) Knob::id, #id

constexpr KnobInfo kKnobs[] = {
    {KNOB(kLogLevel), "NUCLEUS_LOG_LEVEL", KnobType::kEnum, "trace, debug, info, warn, error, off", "info",
     "log level of the stderr logger; another name: a warning, then info", "src/core/logging.cpp"},
    {KNOB(kCpuThreads), "NUCLEUS_CPU_THREADS", KnobType::kInt, "1..4096", "hardware concurrency",
     "threads of the CPU reference and the weight check; a malformed value: a warning, then the core count",
     "src/core/parallel.cpp"},
    {KNOB(kCudaPoisonAllocs), "NUCLEUS_CUDA_POISON_ALLOCS", KnobType::kInt,
     "0 (off), 1 (0xff) or a byte 0..255 (e.g. 0x7e)", "0",
     "debug: fill every new CUDA allocation with the byte (0xff: NaN in bf16, f32, e4m3); slow",
     "src/core/cuda/context.cpp, src/model/deepseek/deepseek_model.cpp"},
    {KNOB(kEnablePrezero), "NUCLEUS_ENABLE_PREZERO", KnobType::kFlag, "", "0",
     "run the prezero pass on the decode graph (a fused add+RMSNorm zero-fills the split-K GEMMs' output)",
     "src/cli/engine_args.cpp, src/ops/splitk.cpp"},
    {KNOB(kPrezeroIdleBytesPerSm), "NUCLEUS_PREZERO_IDLE_BYTES_PER_SM", KnobType::kInt, ">= 1", "65536",
     "the prezero gate's credit of fill bytes per idle SM; a malformed value is refused at start-up",
     "src/ops/prezero.cpp"},
    {KNOB(kSplitK), "NUCLEUS_SPLITK", KnobType::kEnum, "auto, 0, 1 (also off/false, on/true; any case)",
     "auto with NUCLEUS_ENABLE_PREZERO=1, else 0",
     "bf16 decode GEMMs run the split-K kernel: never, on the measured shapes, or at every m <= 64; "
     "a malformed value is refused at start-up",
     "src/ops/splitk.cpp"},
    {KNOB(kSplitKDeterministic), "NUCLEUS_SPLITK_DETERMINISTIC", KnobType::kFlag, "", "0",
     "split-K reduces its splits in a fixed order instead of f32 atomics (bit-identical runs; slower)",
     "src/ops/splitk.cpp"},
    {KNOB(kSkinny), "NUCLEUS_SKINNY", KnobType::kEnum, "auto, 0, 1 (also off/false, on/true; any case)", "auto",
     "bf16 decode GEMMs at m <= 8 run the skinny kernel: on the measured shapes, never, or always; "
     "a malformed value is refused at start-up",
     "src/ops/skinny.cpp"},
    {KNOB(kSkinnyFp8), "NUCLEUS_SKINNY_FP8", KnobType::kEnum, "auto, 0, 1 (also off/false, on/true; any case)",
     "auto",
     "FP8 block-scaled decode GEMMs at m <= 16 (k a multiple of 128) run the FP8 skinny kernel: by the rule, "
     "never, or always; a malformed value is refused at start-up",
     "src/ops/skinny.cpp"},
    {KNOB(kSkinnyFp8Pipeline), "NUCLEUS_SKINNY_FP8_PIPELINE", KnobType::kEnum,
     "auto, 0, 1 (also off/false, on/true; any case)", "auto",
     "the FP8 skinny kernel keeps two steps of weight loads in flight a lane (the next step's issued before this "
     "step's math): where its grid fits one wave (auto), always, or never; a malformed value is refused at "
     "start-up",
     "src/ops/skinny.cpp"},
    {KNOB(kSkinnyFp8Stream), "NUCLEUS_SKINNY_FP8_STREAM", KnobType::kEnum,
     "auto, 0, 1 (also off/false, on/true; any case)", "auto",
     "the FP8 skinny kernel's stream scheme (the bf16 skinny kernel's 4-row warps and 512-byte row loads, f32 "
     "FMAs): auto at m = 1 on every FP8 decode GEMM of a weight of 2 MiB or more, those above 48 MB included "
     "(cuBLASLt's FP8 GEMM there otherwise), 1 at every m <= 2 the skinny kernel takes, 0 never; a malformed "
     "value is refused at start-up",
     "src/ops/skinny.cpp"},
    {KNOB(kPdl), "NUCLEUS_PDL", KnobType::kEnum, "0, 1, gemms", "1",
     "skinny decode GEMMs (bf16 and FP8), the MoE decode kernels, the grouped MoE path's five kernels and decode "
     "attention's small-row kernels launch "
     "as programmatic dependents (PDL) of the kernel before them, and with 1 also the RMSNorm, add+RMSNorm, "
     "SwiGLU, RoPE + cache write and MoE routing kernels (gemms: not those, the setting before they took part); "
     "a malformed value is refused at start-up",
     "src/ops/skinny.cpp"},
    {KNOB(kForceKernel), "NUCLEUS_FORCE_KERNEL", KnobType::kList, "family=backend[,...]", "(none)",
     "force a backend of an op family for A/B runs; an unknown family or backend is an error", "src/ops/op.cpp"},
    {KNOB(kDumpGraph), "NUCLEUS_DUMP_GRAPH", KnobType::kFlag, "", "0",
     "print the prefill and decode step graphs before and after the passes to stderr at start-up",
     "src/model/deepseek/deepseek_model.cpp"},
    {KNOB(kProfileOps), "NUCLEUS_PROFILE_OPS", KnobType::kEnum, "a flag value, or node", "0",
     "time every eager op and print totals per op family/backend (node: per graph node) at exit",
     "src/graph/op_profiler.cpp"},
    {KNOB(kGraphEagerPad), "NUCLEUS_GRAPH_EAGER_PAD", KnobType::kFlag, "", "0",
     "decode steps that would replay a CUDA graph run the same padded step eagerly", "src/cli/engine_args.cpp"},
    {KNOB(kTokenGraphSizes), "NUCLEUS_TOKEN_GRAPH_SIZES", KnobType::kList, "N[,N...] (positive integers)",
     "256,512,1024,2048,3072", "prefill token-graph buckets (empty: none); --token-graph-sizes overrides",
     "src/graph/step_executor.cpp"},
    {KNOB(kTokenGraphEagerPad), "NUCLEUS_TOKEN_GRAPH_EAGER_PAD", KnobType::kFlag, "", "0",
     "padded prefill steps run eagerly instead of replaying the token graphs", "src/cli/engine_args.cpp"},
    {KNOB(kMultiTokenDecode), "NUCLEUS_MULTI_TOKEN_DECODE", KnobType::kFlag, "", "1",
     "steps of 2..4 tokens a sequence (MTP verify, MTP passes, short prompts) run as decode rows through the "
     "decode graphs (0: the prefill path)",
     "src/cli/engine_args.cpp"},
    {KNOB(kMtpDeviceHidden), "NUCLEUS_MTP_DEVICE_HIDDEN", KnobType::kEnum,
     "auto, 0, 1 (also off/false, on/true; any case)", "auto",
     "the MTP module's input rows (the target's hidden states, its own for chained drafts) are gathered on "
     "the device (auto and 1: so, without a tensor-parallel group; 0: copied to the host and uploaded, the path "
     "before); the same rows; a malformed value is refused at start-up",
     "src/model/deepseek/deepseek_model.cpp, src/runtime/model_executor.cpp"},
    {KNOB(kMlaPrefillWgmma), "NUCLEUS_MLA_PREFILL_WGMMA", KnobType::kFlag, "", "1",
     "the prefill attention kernel uses wgmma (0: mma.sync)", "src/ops/mla_prefill_cuda.cpp"},
    {KNOB(kMoeChunkTokens), "NUCLEUS_MOE_CHUNK_TOKENS", KnobType::kInt, ">= 1 (smaller values count as 1)",
     "max(first step's tokens, 4096)", "tokens per chunk of the grouped MoE path", "src/model/deepseek/deepseek_model.cpp, src/ops/moe_grouped_cuda.cpp"},
    {KNOB(kMoeDecode), "NUCLEUS_MOE_DECODE", KnobType::kEnum, "auto, 0 (also off/false), 1..16", "auto",
     "routed experts of decode steps of at most N tokens run the fused decode kernel (auto: none, measured "
     "slower than the grouped GEMMs; "
     "0: never); a malformed value is refused at start-up",
     "src/ops/moe_decode.cpp"},
    {KNOB(kMoeFp8RegisterDequant), "NUCLEUS_MOE_FP8_REGISTER_DEQUANT", KnobType::kFlag, "", "1",
     "the grouped MoE GEMMs convert FP8 expert weights to bf16 in registers at decode tile sizes (16 and 32 "
     "rows), exactly, with the block scale on the f32 sums (0: through a bf16 shared-memory tile of q * scale)",
     "src/ops/moe_grouped_cuda.cpp"},
    {KNOB(kMoeUpSplitK), "NUCLEUS_MOE_UP_SPLIT_K", KnobType::kEnum, "auto, 0 (also off/false/1), 2..8", "auto",
     "the grouped MoE path's UP GEMM at decode steps splits K over this many CTAs a column tile (auto: enough "
     "for two CTAs an SM, up to 8; and 2 for a bf16 grid the deep ring would run over a second wave when the "
     "halves fit at once on the 4-stage ring); a malformed value is refused at start-up",
     "src/ops/moe_decode.cpp"},
    {KNOB(kMoeDeepRing), "NUCLEUS_MOE_DEEP_RING", KnobType::kEnum,
     "auto, 0, 1 (also off/false, on/true; any case)", "auto",
     "the grouped MoE GEMMs with 16-row bf16 tiles stream weights through an 8-stage cp.async ring (one CTA an "
     "SM) instead of 4 stages (auto: the measured rule kernels::moe_grouped_deep_ring, where a launch has few "
     "CTAs an SM; 0: never, the setting before; 1: at every 16-row bf16 GEMM); a malformed value is refused at "
     "start-up",
     "src/ops/moe_decode.cpp"},
    {KNOB(kMoeAlignFree), "NUCLEUS_MOE_ALIGN_FREE", KnobType::kEnum,
     "auto, 0, 1 (also off/false, on/true; any case)", "auto",
     "one-token steps of the grouped MoE path skip the align launch: pair k is m-tile k of expert topk_ids[k] "
     "(auto and 1: so; 0: the align kernel at every step, the path before); the output is the same bit for "
     "bit; a malformed value is refused at start-up",
     "src/ops/moe_decode.cpp"},
    {KNOB(kMoeRouteRegs), "NUCLEUS_MOE_ROUTE_REGS", KnobType::kEnum,
     "auto, 0, 1 (also off/false, on/true; any case)", "auto",
     "the MoE router's top-k runs in registers with redux.sync argmaxes where the routing params allow "
     "(kernels::moe_route_regs_supported; auto and 1: so; 0: the shared-memory kernel, the path before); the "
     "same selection and weights; a malformed value is refused at start-up",
     "src/ops/moe_decode.cpp"},
    {KNOB(kMoeCombinePrefetch), "NUCLEUS_MOE_COMBINE_PREFETCH", KnobType::kEnum,
     "auto, 0, 1 (also off/false, on/true; any case)", "auto",
     "the grouped MoE path's combine loads the positions and weights of 8 pairs, then their rows, then sums "
     "in k order (auto and 1: so; 0: one pair after another, the path before); the output is the same bit "
     "for bit; a malformed value is refused at start-up",
     "src/ops/moe_decode.cpp"},
    {KNOB(kMoeFuseShared), "NUCLEUS_MOE_FUSE_SHARED", KnobType::kEnum,
     "auto, 0, 1 (also off/false, on/true; any case)", "auto",
     "decode steps run the shared experts as routed experts (extra expert ids with weight 1 in the routed "
     "experts' op: one MoE op a layer instead of the shared MLP's three launches; 1: on; auto: on for CUDA "
     "(measured 3.5-4.7% faster on V2-Lite at batch 8-32, neutral on V3), off for the CPU reference; 0: off, the shared MLP "
     "as its own ops); read when the weights are loaded; a malformed value is refused at load",
     "src/model/weights.cpp"},
    {KNOB(kMoeCombineNorm), "NUCLEUS_MOE_COMBINE_NORM", KnobType::kEnum,
     "auto, 0, 1 (also off/false, on/true; any case)", "auto",
     "decode graphs fold the residual add + RMSNorm after a MoE layer into the MoE op where that op is the "
     "last writer of the delta (shared experts fused or absent, one rank, no bf16 emulation): on CUDA the "
     "combine kernel runs the norm, one launch a layer fewer (auto and 1: so; 0: the norm as its own op, the "
     "graph before); the same bits; read when a graph is built; a malformed value is refused at start-up",
     "src/model/deepseek/deepseek_model.cpp"},
    {KNOB(kMoeUpStream), "NUCLEUS_MOE_UP_STREAM", KnobType::kEnum,
     "auto, 0, 1 (also off/false, on/true; any case)", "auto",
     "one-token MoE steps with FP8 gate_up weights (128-wide K blocks) run the UP GEMM in the FP8 stream scheme "
     "of the skinny GEMMs (4 weight rows a warp, 512 contiguous bytes a load instruction, f32 FMAs) instead of "
     "16-row MMA tiles (auto: by the rule kernels::moe_grouped_up_stream; 1: wherever it applies; 0: never, the "
     "path before); the same h up to f32 summation order; a malformed value is refused at start-up",
     "src/ops/moe_decode.cpp"},
    {KNOB(kMoeWgmma), "NUCLEUS_MOE_WGMMA", KnobType::kEnum,
     "auto, 0, 1 (also off/false, on/true; any case)", "auto",
     "MoE steps of 128-row m-tiles (prefill-sized) run the grouped UP and DOWN GEMMs on Hopper wgmma (128 x 256 "
     "tiles, two warpgroups, FP8 weights converted to bf16 in shared memory) instead of mma.sync 128 x 128 tiles "
     "(auto: by the rule kernels::moe_grouped_wgmma; 1: wherever it applies; 0: never, the path before); the same "
     "outputs up to f32 summation order; a malformed value is refused at start-up",
     "src/ops/moe_decode.cpp"},
    {KNOB(kMoeFp8W8a8), "NUCLEUS_MOE_FP8_W8A8", KnobType::kEnum,
     "auto, 0, 1 (also off/false, on/true; any case)", "auto",
     "MoE steps of 128-row m-tiles (prefill-sized) with FP8 experts in 128 x 128 blocks quantize x and h per "
     "1 x 128 block to e4m3 (DeepSeek-V3's act_quant, as the dense layers' cuBLASLt FP8 GEMMs) and run UP and "
     "DOWN on FP8 wgmma, the block scales applied to each 128-wide k block's f32 sums (auto: by the rule "
     "kernels::moe_grouped_w8a8; 1: wherever it applies; 0: never, bf16 activations against weights converted "
     "to bf16, the path before); changes the numerics (activations rounded to e4m3); a malformed value is refused "
     "at start-up",
     "src/ops/moe_decode.cpp"},
    {KNOB(kPackedUpload), "NUCLEUS_PACKED_UPLOAD", KnobType::kEnum,
     "auto, 0, 1 (also off/false, on/true; any case)", "auto",
     "a step on the decode-graph route uploads its metadata packed by its own lengths in one host-to-device copy "
     "instead of up to nine at capacity offsets (auto and 1: so; 0: the nine copies); the same bits; read when the "
     "step executor is created; a malformed value is refused at start-up",
     "src/graph/step_executor.cpp, src/model/deepseek/deepseek_model.cpp"},
    {KNOB(kMlaDecodeSmallGemms), "NUCLEUS_MLA_DECODE_SMALL_GEMMS", KnobType::kEnum,
     "auto, 0, 1 (also off/false, on/true; any case)", "auto",
     "decode attention calls of a few rows run the q absorption and the output projection (W_UK, W_UV) as "
     "own kernels that read kv_b_proj directly (FP8 as stored), fused with the q gather and the split combine, "
     "with PDL: auto by the measured rule (8 rows with an FP8 kv_b_proj or <= 16 heads, else 4), 1 at most 8, "
     "0 never (cuBLASLt batched GEMMs on a bf16 kv_b_proj); a malformed value is refused at start-up",
     "src/ops/mla_decode.cpp"},
    {KNOB(kMlaDecodeSplitKeys), "NUCLEUS_MLA_DECODE_SPLIT_KEYS", KnobType::kEnum,
     "auto, or N: a multiple of 32 from 32 to 1024", "auto",
     "the nucleus decode attention kernel's KV splits stream at least N keys each (auto: the measured rule "
     "mla_decode_min_split_keys_auto; 128 is the fixed minimum before the switch); a malformed value is "
     "refused at start-up",
     "src/ops/mla_decode.cpp"},
    {KNOB(kMlaDecodeCtasPerSm), "NUCLEUS_MLA_DECODE_CTAS_PER_SM", KnobType::kEnum, "auto, 1, 2", "auto",
     "the nucleus decode attention kernel at 16 heads a CTA runs 2 CTAs a multiprocessor with a shallower "
     "cp.async ring (auto: the measured rule mla_decode_ctas_per_sm_auto; 1: one CTA with the deep ring, the "
     "kernel before the switch); a malformed value is refused at start-up",
     "src/ops/mla_decode.cpp"},
    {KNOB(kMlaDecodeKeyTile), "NUCLEUS_MLA_DECODE_KEY_TILE", KnobType::kEnum, "auto, 32, 64", "auto",
     "the nucleus decode attention kernel at 16 heads a CTA (one CTA a multiprocessor) streams 64-key tiles, "
     "each warp scoring its own 8 keys over all dims with one shared softmax a tile (auto: the measured rule "
     "mla_decode_key_tile_auto; 32: the 32-key kernel before the switch); a malformed value is refused at "
     "start-up",
     "src/ops/mla_decode.cpp"},
    {KNOB(kMlaDecodeBulkLoads), "NUCLEUS_MLA_DECODE_BULK_LOADS", KnobType::kEnum,
     "auto, 0, 1 (also off/false, on/true; any case)", "auto",
     "the 64-key decode attention kernel loads each cache row with one bulk asynchronous copy (cp.async.bulk, "
     "L2 evict-first, completion on a shared-memory mbarrier) instead of 16-byte cp.async pieces (auto: the "
     "measured rule mla_decode_bulk_loads_auto, bulk for bf16 and fp8_ds_mla rows; 0: cp.async, the loader before "
     "the switch); a malformed value is refused at start-up",
     "src/ops/mla_decode.cpp"},
    {KNOB(kMlaDecodeFp8RegisterConvert), "NUCLEUS_MLA_DECODE_FP8_REGISTER_CONVERT", KnobType::kEnum,
     "auto, 0, 1 (also off/false, on/true; any case)", "auto",
     "the 64-key decode attention kernel on an FP8 cache builds its key and value MMA fragments from the raw "
     "rows in registers (f16 MMAs, q scaled by a power of two) instead of converting each tile to bf16 through "
     "shared memory (auto: the measured rule mla_decode_fp8_register_convert_auto, fp8_e4m3 always, fp8_ds_mla "
     "from 64 rows; 0: the shared-memory conversion, the path before the switch); a malformed value is refused "
     "at start-up",
     "src/ops/mla_decode.cpp"},
    {KNOB(kMlaDecodeWgmma), "NUCLEUS_MLA_DECODE_WGMMA", KnobType::kEnum,
     "auto, 0, 1 (also off/false, on/true; any case)", "auto",
     "the decode attention runs 64 heads a CTA on Hopper wgmma (kernels/mla/mla_decode_wgmma.cu) where the "
     "layer has a multiple of 64 heads and a bf16 cache (auto: the rule mla_decode_wgmma_auto, every such call; "
     "0: the mma.sync kernels, 32 heads a CTA); a malformed value is refused at start-up",
     "src/ops/mla_decode.cpp"},
    {KNOB(kFuseKvANorm), "NUCLEUS_FUSE_KV_A_NORM", KnobType::kEnum, "auto, 0, 1 (also off/false, on/true; any case)",
     "auto",
     "kv_a_layernorm runs inside the RoPE + latent-cache-write op (one kernel instead of two a layer; the same bytes "
     "in the cache) instead of as its own RMSNorm op (auto and 1: fused; 0: its own op, the graph before the "
     "switch); read when the graphs are built; a malformed value is refused at start-up",
     "src/model/deepseek/deepseek_model.cpp"},
    {KNOB(kDecodePrograms), "NUCLEUS_DECODE_PROGRAMS", KnobType::kFlag, "", "0",
     "CUDA decode graphs run each layer's attention front (input add + norm, q projections, kv_a, RoPE + cache "
     "write) and each MoE layer's o_proj and MoE block (post-attention add + norm, router, routing, routed and "
     "shared experts) as decode programs, one launch each, the persistent kernel of docs/decode_program.md, for steps of at most 8 "
     "rows (the separate ops for wider ones); bf16 weights, one rank; else the separate ops with a warning; "
     "read when a graph is built",
     "src/model/deepseek/deepseek_model.cpp"},
    {KNOB(kDecodeProgramJoin), "NUCLEUS_DECODE_PROGRAM_JOIN", KnobType::kFlag, "", "1",
     "with NUCLEUS_DECODE_PROGRAMS=1, each MoE layer's program also runs the next layer's attention front (one "
     "launch a layer boundary instead of two; ops/moe_program_op.h); 0: the two as separate programs; read when a "
     "graph is built",
     "src/model/deepseek/deepseek_model.cpp"},
    {KNOB(kDecodeProgramAbsorb), "NUCLEUS_DECODE_PROGRAM_ABSORB", KnobType::kFlag, "", "1",
     "with NUCLEUS_DECODE_PROGRAMS=1, each front program also writes the decode attention's absorbed query (q_nope "
     ". W_UK and the rotated q_pe; ops/front_program_op.h), which the attention op then reads for steps of at most 8 "
     "rows instead of running its absorption kernel; 0: the attention op absorbs; read when a graph is built",
     "src/model/deepseek/deepseek_model.cpp"},
    {KNOB(kDecodeProgramAttnOutput), "NUCLEUS_DECODE_PROGRAM_ATTN_OUTPUT", KnobType::kFlag, "", "1",
     "with NUCLEUS_DECODE_PROGRAMS=1, each MoE layer's program also merges the decode attention's KV splits and "
     "applies W_UV (ops/moe_program_op.h), the attention op stopping after its kernel, for steps of at most 8 rows; "
     "0: the attention op's own output kernel; read when a graph is built",
     "src/model/deepseek/deepseek_model.cpp"},
    {KNOB(kDecodeProgramMaxRows), "NUCLEUS_DECODE_PROGRAM_MAX_ROWS", KnobType::kEnum, "1, 2, 4, 8", "8",
     "with NUCLEUS_DECODE_PROGRAMS=1, the decode-program ops run steps of at most this many rows as programs "
     "(widths 1 ... it) and wider steps as the separate ops they hold; read when a graph is built; another value "
     "is refused at start-up",
     "src/ops/decode_program.cpp"},
    {KNOB(kDecodeProgramAttention), "NUCLEUS_DECODE_PROGRAM_ATTENTION", KnobType::kFlag, "", "0",
     "with NUCLEUS_DECODE_PROGRAMS=1 (and the absorption and attention output switches on), each front program also "
     "runs the layer's decode attention (a kAttend stage on CUDA cores, docs/decode_program.md) and the attention op "
     "does nothing for the steps programs run: a layer is one program; off by default until measured against the "
     "attention kernels; read when a graph is built",
     "src/model/deepseek/deepseek_model.cpp"},
    {KNOB(kDecodeProgramDense), "NUCLEUS_DECODE_PROGRAM_DENSE", KnobType::kFlag, "", "1",
     "with NUCLEUS_DECODE_PROGRAMS=1, each dense layer's o_proj, post-attention add + norm and MLP also run as one "
     "program (ops/moe_program_op.h dense(), joined with the next layer's front like a MoE block); 0: the separate "
     "ops; read when a graph is built",
     "src/model/deepseek/deepseek_model.cpp"},
    {KNOB(kDecodeProgramLean), "NUCLEUS_DECODE_PROGRAM_LEAN", KnobType::kFlag, "", "1",
     "with NUCLEUS_DECODE_PROGRAMS=1, each program launches the smallest build of the decode-program kernel that "
     "runs its stages (no FP8 code for bf16 weights, no attention or MoE code for plain GEMV stages: less code to "
     "fetch); 0: always the full build; the same bits either way; read when the programs are reserved",
     "src/ops/decode_program_cuda.cpp"},
    {KNOB(kDecodeProgramRelease), "NUCLEUS_DECODE_PROGRAM_RELEASE", KnobType::kFlag, "", "1",
     "with NUCLEUS_DECODE_PROGRAMS=1, a program's CTAs count their jobs of a stage with one release add after the "
     "last of them and wait with acquire polls (kernels/mono Program::release_counters); 0: a fence and an atomic "
     "add a job, a fence after each wait; the same bits either way; read when the programs are reserved",
     "src/ops/decode_program_cuda.cpp"},
    {KNOB(kWidthBuilds), "NUCLEUS_WIDTH_BUILDS", KnobType::kEnum, "0, 1, lean", "0",
     "the decode graph's MLA front end runs as NVRTC width builds (lean: never fused); "
     "another value is refused at start-up",
     "src/jit/width_build_policy.cpp"},
    {KNOB(kWidthCooperative), "NUCLEUS_WIDTH_COOPERATIVE", KnobType::kEnum, "0, 1", "1",
     "width builds launch cooperatively (0: plain cuLaunchKernel, for A/B runs)",
     "src/jit/mla_front_builds_cuda.cpp"},
    {KNOB(kStrictWidths), "NUCLEUS_STRICT_WIDTHS", KnobType::kFlag, "", "0",
     "a decode width the width builds cannot serve is a start-up error instead of a warning",
     "src/jit/width_build_policy.cpp"},
    {KNOB(kKernelCacheDir), "NUCLEUS_KERNEL_CACHE_DIR", KnobType::kString, "a directory",
     "$XDG_CACHE_HOME/nucleus/kernels, else ~/.cache/nucleus/kernels",
     "where width builds are cached (set and empty: no cache)", "src/jit/kernel_cache.cpp"},
    {KNOB(kWidthMaxrregcount), "NUCLEUS_WIDTH_MAXRREGCOUNT", KnobType::kInt, "16..255", "no cap",
     "debug: cap the fused width builds' registers a thread (to force spills)",
     "src/jit/mla_front_builds_cuda.cpp"},
    {KNOB(kWidthMaxrregcountLean), "NUCLEUS_WIDTH_MAXRREGCOUNT_LEAN", KnobType::kInt, "16..255", "no cap",
     "debug: cap the lean width builds' registers a thread", "src/jit/mla_front_builds_cuda.cpp"},
    {KNOB(kFuseAllreduceNorm), "NUCLEUS_FUSE_ALLREDUCE_NORM", KnobType::kFlag, "", "1",
     "tensor parallelism on CUDA: the fused all-reduce + add + RMSNorm kernel (0: NCCL, then add+RMSNorm)",
     "src/cli/engine_args.cpp"},
    {KNOB(kFusedAllreduceMaxBytes), "NUCLEUS_FUSED_ALLREDUCE_MAX_BYTES", KnobType::kInt, ">= 0",
     "the measured choice (ops/allreduce_choice.h)",
     "byte limit on the per-rank delta of steps the fused all-reduce + RMSNorm kernel takes",
     "src/model/deepseek/deepseek_model.cpp, src/ops/collective_ops_cuda.cpp"},
    {KNOB(kNcclLibrary), "NUCLEUS_NCCL_LIBRARY", KnobType::kString, "a path to libnccl.so.2",
     "the loader path, then the Python wheels, then the CUDA toolkit",
     "the NCCL library tensor parallelism loads (set and empty: the default)", "src/comm/nccl_communicator.cpp"},
    {KNOB(kFaultInject), "NUCLEUS_FAULT_INJECT", KnobType::kString, "<op kind>:<n>[:fatal]", "(none)",
     "test only: the n-th run of an op of that kind reports an error (fatal: the model becomes unusable)",
     "src/graph/step_executor.cpp"},
};

#undef KNOB

constexpr bool registry_in_order() {
  for (size_t i = 0; i < std::size(kKnobs); ++i)
    if (static_cast<size_t>(kKnobs[i].knob) != i) return false;
  return std::size(kKnobs) == static_cast<size_t>(Knob::kCount);
}
static_assert(registry_in_order(), "kKnobs must list every Knob once, in enum order");

constexpr bool flag_defaults_valid() {
  for (const KnobInfo& k : kKnobs)
    if (k.type == KnobType::kFlag && std::string_view(k.default_value) != "0" &&
        std::string_view(k.default_value) != "1")
      return false;
  return true;
}
static_assert(flag_defaults_valid(), "a flag's default is \"0\" or \"1\"");

constexpr std::string_view kPrefix = "NUCLEUS_";

}  // namespace

std::span<const KnobInfo> all_knobs() { return kKnobs; }

const KnobInfo& knob_info(Knob k) {
  const auto i = static_cast<size_t>(k);
  NUCLEUS_CHECK(i < std::size(kKnobs), "knob {} out of range", i);
  return kKnobs[i];
}

const char* knob_name(Knob k) { return knob_info(k).name; }

const char* knob_type_name(KnobType t) {
  switch (t) {
    case KnobType::kFlag: return "flag";
    case KnobType::kInt: return "int";
    case KnobType::kString: return "string";
    case KnobType::kList: return "list";
    case KnobType::kEnum: return "enum";
  }
  return "?";
}

std::optional<std::string> env_string(Knob k) {
  const char* v = std::getenv(knob_name(k));
  if (!v) return std::nullopt;
  return std::string(v);
}

bool env_flag(Knob k) {
  const KnobInfo& info = knob_info(k);
  NUCLEUS_CHECK(info.type == KnobType::kFlag, "{} is a {}, not a flag", info.name, knob_type_name(info.type));
  auto v = env_string(k);
  return v ? parse_flag(*v) : parse_flag(info.default_value);
}

std::optional<std::string> foreign_env(const char* name) {
  NUCLEUS_CHECK(std::string_view(name).substr(0, kPrefix.size()) != kPrefix,
                "{} is a NUCLEUS_* switch: register it in core/knobs.cpp and read it through its Knob", name);
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  return std::string(v);
}

bool parse_flag(std::string_view text) {
  std::string s(text);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s == "1" || s == "true" || s == "yes" || s == "on";
}

std::optional<AutoSwitch> env_auto_switch(Knob k) {
  const auto v = env_string(k);
  if (!v) return AutoSwitch::kAuto;
  std::string t = *v;
  std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
  if (t.empty() || t == "auto") return AutoSwitch::kAuto;
  if (t == "0" || t == "off" || t == "false") return AutoSwitch::kOff;
  if (t == "1" || t == "on" || t == "true") return AutoSwitch::kOn;
  return std::nullopt;
}

Status auto_switch_env_status(Knob k) {
  if (env_auto_switch(k)) return ok_status();
  return invalid_argument(std::string(knob_info(k).name) + "='" + env_string(k).value_or("") +
                          "' is not auto, 0 (off, false) or 1 (on, true)");
}

bool flag_value_ok(std::string_view text) {
  std::string s(text);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s.empty() || s == "1" || s == "true" || s == "yes" || s == "on" || s == "0" || s == "false" || s == "no" ||
         s == "off";
}

Status flag_env_status() {
  for (const KnobInfo& k : all_knobs()) {
    if (k.type != KnobType::kFlag) continue;
    const char* v = std::getenv(k.name);
    if (!v || flag_value_ok(v)) continue;
    return invalid_argument(std::string(k.name) + "='" + v +
                            "' is not a flag value (1/true/yes/on, or 0/false/no/off; default " + k.default_value +
                            ")");
  }
  return ok_status();
}

std::optional<int64_t> parse_int(std::string_view text, int base) {
  if (text.empty()) return std::nullopt;
  const std::string s(text);  // strtoll needs the terminator
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, base);
  if (end == s.c_str() || *end != '\0' || errno == ERANGE) return std::nullopt;
  return static_cast<int64_t>(v);
}

Status int_knob_env_status(Knob k, int64_t lo, int64_t hi, const char* expected, int base) {
  const std::optional<std::string> v = env_string(k);
  if (!v) return ok_status();
  const std::optional<int64_t> n = parse_int(*v, base);
  if (n && *n >= lo && *n <= hi) return ok_status();
  return invalid_argument(std::string(knob_info(k).name) + "='" + *v + "' is not " + expected);
}

std::string knobs_help_text() {
  std::string out =
      "Environment switches (NUCLEUS_*); docs/flags.md has the details.\n"
      "flag: 1, true, yes, on (any case) set; 0, false, no, off or empty not set; any other value is refused at "
      "start-up.\n\n";
  for (const KnobInfo& k : kKnobs) {
    out += k.name;
    out += "  ";
    out += knob_type_name(k.type);
    if (*k.values) out += std::string(": ") + k.values;
    out += std::string("  default: ") + k.default_value + "\n    " + k.doc + "\n";
  }
  return out;
}

namespace {

// Levenshtein distance (insertions, deletions, substitutions of one character).
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

std::vector<UnknownEnvSwitch> unknown_env_switches() {
  // The test harness's variables (tests/CMakeLists.txt), after the prefix.
  static constexpr std::string_view kHarness[] = {"BIN", "MODELS_DIR", "PY_VENV", "LM_EVAL_VENV"};
  std::vector<UnknownEnvSwitch> out;
  for (char** e = environ; e && *e; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    if (name.substr(0, 8) != "NUCLEUS_") continue;
    if (std::find(std::begin(kHarness), std::end(kHarness), name.substr(8)) != std::end(kHarness)) continue;
    bool known = false;
    size_t best = 4;
    std::string nearest;
    for (const KnobInfo& k : kKnobs) {
      if (name == k.name) {
        known = true;
        break;
      }
      const size_t d = edit_distance(name, k.name);
      if (d < best) {
        best = d;
        nearest = k.name;
      }
    }
    if (!known) out.push_back({std::string(name), nearest});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return out;
}

}  // namespace nucleus
