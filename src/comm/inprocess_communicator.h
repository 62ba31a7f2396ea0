// The in-process communicator: the ranks of a tensor-parallel group are
// threads of one process and exchange data through host memory. Used by the
// CPU engine (`nucleus generate --device cpu --tensor-parallel-size N`) and by
// the CPU tests that check TP = 2, 4 against TP = 1.
#pragma once

#include "comm/communicator.h"

namespace nucleus {

// The communicators of one group of `world_size` ranks (element r is rank r's;
// each must be used by one thread at a time). Host buffers only. All-reduce
// is a reduce-scatter then an all-gather through a shared f32 buffer: rank r
// sums its 1/world_size of the elements over the ranks in rank order, so the
// result does not depend on timing and every rank gets the same bits.
// Errors: world_size < 1.
StatusOr<std::vector<std::unique_ptr<Communicator>>> make_inprocess_communicators(int world_size);

}  // namespace nucleus
