// Content checksums: 64-bit, fast (several GB/s on one core), for detecting
// corruption of session files and fingerprinting model files. Not a
// cryptographic hash: it guards against accidents, not adversaries.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace aoti_sessions {

// The XXH64 function of `bytes` bytes at `data` (XXH64("", 0) is
// 0xEF46DB3751D8E999).
uint64_t Checksum64(const void* data, size_t bytes, uint64_t seed = 0);

// A fingerprint of a file's whole content and size, read in chunks from the
// open descriptor `fd` (from its start; `path` names it in errors). Throws
// kPackage if it cannot be read. Gives up (returning 0) once `*cancel` is set.
uint64_t HashFile(int fd, const std::string& path, const std::atomic<bool>* cancel = nullptr);

}  // namespace aoti_sessions
