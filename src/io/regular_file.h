// Opening checkpoint and config files without blocking: a FIFO, a device, a
// socket or a directory where a model file belongs is refused before any read
// (reading a FIFO with no writer would hang the load forever).
#pragma once

#include <string>

#include "core/status.h"

namespace nucleus {

// Opens `path` read-only and non-blocking and returns its descriptor when it
// is a regular file (the caller closes it). Errors: kNotFound when it cannot
// be opened (naming the OS reason); kInvalidArgument when it is not a regular
// file, naming its kind ("a FIFO", "a directory", ...).
StatusOr<int> open_regular_file(const std::string& path);

// The whole contents of the regular file `path`. Errors: open_regular_file's,
// and kDataLoss on a read error.
StatusOr<std::string> read_regular_file(const std::string& path);

}  // namespace nucleus
