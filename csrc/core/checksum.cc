// XXH64, written from its public specification (four 64-bit lanes over
// 32-byte stripes, then a tail and an avalanche).
#include "checksum.h"

#include <cerrno>
#include <cstring>
#include <vector>

#include "errors.h"
#include "posix_file.h"

namespace aoti_sessions {
namespace {

constexpr uint64_t kP1 = 11400714785074694791ULL;
constexpr uint64_t kP2 = 14029467366897019727ULL;
constexpr uint64_t kP3 = 1609587929392839161ULL;
constexpr uint64_t kP4 = 9650029242287828579ULL;
constexpr uint64_t kP5 = 2870177450012600261ULL;

inline uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

inline uint64_t Read64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);  // little-endian hosts only (x86-64, aarch64)
  return v;
}

inline uint32_t Read32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline uint64_t Round(uint64_t acc, uint64_t input) {
  acc += input * kP2;
  acc = Rotl(acc, 31);
  return acc * kP1;
}

inline uint64_t Merge(uint64_t acc, uint64_t lane) {
  acc ^= Round(0, lane);
  return acc * kP1 + kP4;
}

}  // namespace

uint64_t Checksum64(const void* data, size_t bytes, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  const unsigned char* end = p + bytes;
  uint64_t h;
  if (bytes >= 32) {
    uint64_t v1 = seed + kP1 + kP2, v2 = seed + kP2, v3 = seed, v4 = seed - kP1;
    const unsigned char* limit = end - 32;
    do {
      v1 = Round(v1, Read64(p));
      v2 = Round(v2, Read64(p + 8));
      v3 = Round(v3, Read64(p + 16));
      v4 = Round(v4, Read64(p + 24));
      p += 32;
    } while (p <= limit);
    h = Rotl(v1, 1) + Rotl(v2, 7) + Rotl(v3, 12) + Rotl(v4, 18);
    h = Merge(h, v1);
    h = Merge(h, v2);
    h = Merge(h, v3);
    h = Merge(h, v4);
  } else {
    h = seed + kP5;
  }
  h += bytes;
  for (; p + 8 <= end; p += 8) {
    h ^= Round(0, Read64(p));
    h = Rotl(h, 27) * kP1 + kP4;
  }
  if (p + 4 <= end) {
    h ^= static_cast<uint64_t>(Read32(p)) * kP1;
    h = Rotl(h, 23) * kP2 + kP3;
    p += 4;
  }
  for (; p < end; ++p) {
    h ^= (*p) * kP5;
    h = Rotl(h, 11) * kP1;
  }
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

uint64_t HashFile(int fd, const std::string& path, const std::atomic<bool>* cancel) {
  constexpr size_t kChunk = 16 << 20;
  std::vector<unsigned char> buffer(kChunk);
  uint64_t h = 0;
  uint64_t total = 0;
  for (;;) {
    if (cancel != nullptr && cancel->load()) return 0;
    // Whole chunks: the hash chains one Checksum64 per 16 MiB.
    int64_t filled = ReadAt(fd, buffer.data(), kChunk, total);
    if (filled < 0) {
      Throw(ErrorKind::kPackage, "cannot read " + path + ": " + ErrnoText(errno));
    }
    if (filled == 0) break;
    h = Checksum64(buffer.data(), static_cast<size_t>(filled), h);
    total += static_cast<uint64_t>(filled);
    if (static_cast<size_t>(filled) < kChunk) break;
  }
  return Checksum64(&total, sizeof total, h);
}

}  // namespace aoti_sessions
