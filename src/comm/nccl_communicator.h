// The NCCL communicator: the ranks of a tensor-parallel group are GPUs of one
// host, each driven by its own thread of this process (docs/tp.md says why).
//
// Finding NCCL: nucleus does not link libnccl; it loads libnccl.so.2 with
// dlopen the first time a group is made, so the binary runs (and TP = 1
// serves) on machines without NCCL. It tries, in order:
//   1. $NUCLEUS_NCCL_LIBRARY (a path to libnccl.so.2; only this when set);
//   2. "libnccl.so.2" on the loader's path (LD_LIBRARY_PATH, the executable's
//      RUNPATH $ORIGIN/../lib, the ld.so cache);
//   3. the Python wheels' copies (nvidia-nccl-cu12/cu13: site-packages or
//      dist-packages under $VIRTUAL_ENV, $CONDA_PREFIX, ~/.local, /usr/local,
//      /usr, /opt/conda, /opt/venv, at nvidia/nccl/lib, nvidia/cu13/lib or
//      nvidia/cu12/lib);
//   4. the CUDA toolkit's lib directories (/usr/local/cuda/lib, lib64).
// The error when none loads lists what was tried and how to point nucleus at
// one. NVLink SHARP (multicast) stays off: NCCL_NVLS_ENABLE=0 is set before
// the first communicator unless the user set NCCL_NVLS_ENABLE.
#pragma once

#include <string>

#include "comm/communicator.h"

namespace nucleus {

// One NCCL communicator per GPU in `devices` (ncclCommInitAll: one process,
// rank r on devices[r]); element r must be used by a thread bound to
// devices[r] (cuda::bind_thread_to_device). Collectives take the rank's
// stream and are stream-async and graph-capturable. Errors: NCCL not found
// (the message says where it looked), an NCCL init failure (with NCCL's
// message), an empty or repeated device list. CUDA builds only (kUnsupported
// otherwise).
StatusOr<std::vector<std::unique_ptr<Communicator>>> make_nccl_communicators(const std::vector<int>& devices);

// The path of the libnccl.so.2 that was (or would be) loaded and its version
// ("2.28.9"), or why none could be.
StatusOr<std::string> nccl_library_description();

}  // namespace nucleus
