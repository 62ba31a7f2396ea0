#include "io/regular_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace nucleus {

namespace {

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

Status not_regular(const std::string& path, mode_t mode) {
  return invalid_argument(path + ": is " + kind_of(mode) + ", not a regular file");
}

}  // namespace

StatusOr<int> open_regular_file(const std::string& path) {
  // stat first, so that a device is never opened at all; O_NONBLOCK makes
  // the open itself return at once should the path change to a FIFO between
  // the two calls, and fstat then decides on what was actually opened.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return not_found(path + ": cannot open: " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return not_regular(path, st.st_mode);
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return not_found(path + ": cannot open: " + std::strerror(errno));
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const mode_t mode = st.st_mode;
    ::close(fd);
    return not_regular(path, mode);
  }
  return fd;
}

StatusOr<std::string> read_regular_file(const std::string& path) {
  NUCLEUS_ASSIGN_OR_RETURN(int fd, open_regular_file(path));
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return data_loss(path + ": read error: " + std::strerror(err));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

}  // namespace nucleus
