// A small fork-join helper for the CPU reference. Work is split into
// contiguous chunks; each index is processed by exactly one thread with the
// same code, so results never depend on the thread count.
// NUCLEUS_CPU_THREADS sets the thread count (default: hardware concurrency).
#pragma once

#include <cstdint>
#include <functional>

namespace nucleus {
// Calls fn(begin, end) over [0, total) in chunks of at least `grain` items.
void parallel_for(int64_t total, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);
int cpu_threads();
}  // namespace nucleus
