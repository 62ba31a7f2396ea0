// The one roofline model of every benchmark and table (docs/perf.md
// "Roofline"): the H200 the project measures on. Benchmarks print % of
// kHbmBytesPerSec (memory-bound work) or of the dense peaks (compute-bound
// work); docs/perf.md says which.
#pragma once

namespace nucleus::roofline {

// HBM3e read bandwidth this H200 reaches (a streaming read kernel, docs/gpu.md):
// the figure every "% of roofline" column uses.
constexpr double kHbmBytesPerSec = 4.58e12;
// The spec sheet's 4.8 TB/s, for reference columns only.
constexpr double kHbmSpecBytesPerSec = 4.8e12;
// Dense tensor-core peaks (spec, no sparsity), FLOP/s.
constexpr double kBf16FlopsPerSec = 790e12;
constexpr double kFp8FlopsPerSec = 1580e12;

}  // namespace nucleus::roofline
