// POSIX reads and writes, retried over EINTR and short transfers.
#include "posix_file.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace aoti_sessions {

FileDescriptor::~FileDescriptor() { Close(); }

FileDescriptor& FileDescriptor::operator=(FileDescriptor&& other) noexcept {
  if (this != &other) {
    Close();
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

bool FileDescriptor::Close() {
  if (fd_ < 0) return true;
  return ::close(std::exchange(fd_, -1)) == 0;
}

int64_t ReadAt(int fd, void* dst, size_t bytes, uint64_t offset) {
  auto* out = static_cast<char*>(dst);
  size_t done = 0;
  while (done < bytes) {
    ssize_t n = ::pread(fd, out + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -1;
    if (n == 0) break;  // end of file
    done += static_cast<size_t>(n);
  }
  return static_cast<int64_t>(done);
}

bool WriteAll(int fd, const void* data, size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

std::string ErrnoText(int err) { return std::strerror(err); }

}  // namespace aoti_sessions
