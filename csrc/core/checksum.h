// Content checksums: 64-bit, fast (several GB/s on one core), for detecting
// corruption of session files and fingerprinting model files. Not a
// cryptographic hash: it guards against accidents, not adversaries.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace aoti_sessions {

// The XXH64 function of `bytes` bytes at `data` (XXH64("", 0) is
// 0xEF46DB3751D8E999).
uint64_t Checksum64(const void* data, size_t bytes, uint64_t seed = 0);

// A fingerprint of a file's whole content and size, read in chunks. Throws
// kPackage if the file cannot be read.
uint64_t HashFile(const std::string& path);

// What identifies one version of a file on disk (device, inode, size,
// modification time): equal stamps, same content, for files nobody rewrites
// in place within a clock tick.
struct FileStamp {
  uint64_t device = 0, inode = 0, size = 0;
  int64_t mtime_ns = 0;
  bool operator==(const FileStamp& o) const {
    return device == o.device && inode == o.inode && size == o.size && mtime_ns == o.mtime_ns;
  }
  bool operator!=(const FileStamp& o) const { return !(*this == o); }
};

// Throws kPackage if the file cannot be stat'ed.
FileStamp StampFile(const std::string& path);

}  // namespace aoti_sessions
