// Prezero: a split-K GEMM accumulates atomically into its output, so the
// output must be zero first — a device-wide step per GEMM in decode. The
// prezero pass (graph/passes/prezero_pass.h) hands that zeroing to the fused
// residual-add + RMSNorm that runs just before (the "donor"), which leaves
// most SMs idle in decode: the donor zero-fills one [m, n_total] f32 buffer
// whose slices are the following GEMMs' outputs ("consumers"), and those run
// with zero_init = false. (ROCm/ATOM's prezero; design.md "Graph passes and prezero".)
//
// The gate decides per step, from the step's row count m (so each captured
// graph size decides for itself, never frozen when the graph is built),
// whether the fill fits the donor's idle SMs:
//   fill all n_total columns if is_prezero_free(m, n_total),
//   else only the first n_base columns if is_prezero_free(m, n_base) (the
//   consumers past n_base then zero their own slices),
//   else nothing (every consumer zeroes its own slice).
// Above the most rows at which any consumer honours zero_init (on CUDA the
// split-K kernel serves m <= 64; PrezeroDonor::max_rows) nothing is filled.
// A consumer accumulates into its slice exactly when the donor's decision
// covered it, so ON and OFF compute the same values.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"

namespace nucleus {

constexpr int64_t kPrezeroAnyRows = INT64_MAX;

// SMs the donor kernel runs on: the device's, or 132 (an H200) on the CPU,
// so that the CPU reference takes the same decisions a GPU would.
int prezero_sm_count();

// Whether zero-filling an [m, n] f32 buffer fits the SMs the donor leaves
// idle: the donor takes one block per row, and each idle SM is credited
// prezero_idle_bytes_per_sm() bytes of fill during the donor's lifetime:
//   0 < m < sms  and  m * n * 4 <= (sms - m) * idle_bytes_per_sm.
// A heuristic to be tuned by measurement on the GPU (docs/perf.md).
constexpr int64_t kPrezeroIdleBytesPerSm = 64 * 1024;
bool is_prezero_free(int64_t m, int64_t n);

// Bytes of fill credited to each idle SM: kPrezeroIdleBytesPerSm, or
// NUCLEUS_PREZERO_IDLE_BYTES_PER_SM (read once), or the value a test set.
int64_t prezero_idle_bytes_per_sm();
// Overrides prezero_idle_bytes_per_sm() (tests, tuning); <= 0 restores the
// default. Affects decisions taken afterwards (graphs captured earlier keep
// theirs).
void set_prezero_idle_bytes_per_sm(int64_t bytes);
// OK, or invalid_argument naming a malformed NUCLEUS_PREZERO_IDLE_BYTES_PER_SM
// (which then counts as unset).
Status prezero_env_status();

enum class PrezeroFill { kNone, kBase, kAll };
// The donor's fill for a step of m rows (nothing above max_rows: no consumer
// accumulates there, e.g. split-K serves m <= 64 only).
PrezeroFill prezero_fill(int64_t m, int64_t n_total, int64_t n_base, int64_t max_rows = kPrezeroAnyRows);
const char* prezero_fill_name(PrezeroFill f);

// What the pass sets on a donor (AddRmsNormOp, or a MoeExpertsOp that runs
// the add + norm after it).
struct PrezeroDonor {
  int64_t n_total = 0;  // 0: not a donor
  int64_t n_base = 0;
  int64_t max_rows = kPrezeroAnyRows;  // no fill for steps of more rows
};

// The f32 elements a donor zeroes at the start of its fill buffer ([m,
// n_total], whose slices are column blocks of m rows, so a prefix of columns
// is a prefix of memory) for a step of m rows: m * n_total, m * n_base or 0 by
// prezero_fill; 0 when `d` is not a donor.
int64_t prezero_fill_count(const PrezeroDonor& d, int64_t m);

// A donor's attributes for graph dumps (" prezero_n_total=... prezero_n_base=...
// [prezero_max_rows=...]"), empty when `d` is not a donor.
std::string prezero_attrs(const PrezeroDonor& d);

}  // namespace nucleus
