// Session files: one session's mutable state on disk, with a header that
// fingerprints the engine it came from.
//
// Layout (little-endian):
//   0   magic "AISSTATE"
//   8   u32 format version, u32 reserved (0)
//   16  u64 header length H
//   24  header (H bytes): u64 payload length; u32 methods, each {str name,
//       u64 library hash, u64 weights hash}; u32 buffers, each {str fqn,
//       str dtype, u32 rank, i64 sizes[rank], i64 strides[rank], u64 offset
//       in the payload, u64 bytes, u64 checksum}   (str: u32 length + bytes)
//       Version 2 (pooled state, docs/batching.md) ends the header with
//       i64 positions: the session's length; its buffers are the pooled
//       tensors, each [units, ...] (a page tensor's pages in order, a slot
//       tensor's slot). Block state is written as version 1. Version 3 (a
//       file with an attachment) ends it with i64 positions (-1: block
//       state) and str attachment: the saver's own bytes (an LLM session's
//       tokens), under the header's checksum like the rest.
//   24+H  u64 checksum of bytes [0, 24+H)
//   then zero padding to a multiple of 64, and the payload (each buffer at
//   its offset, 64-byte aligned). The file ends exactly at the payload's end.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "posix_file.h"

namespace aoti_sessions {

constexpr uint32_t kStateFileVersion = 1;        // block state
constexpr uint32_t kPooledStateFileVersion = 2;  // pooled state
constexpr uint32_t kAttachedStateFileVersion = 3;  // either, with an attachment
// The most bytes an attachment may hold.
constexpr size_t kMaxAttachment = 16u << 20;

struct StateFileMethod {
  std::string name;
  uint64_t library_hash = 0;
  uint64_t weights_hash = 0;  // 0: weights embedded in the library
};

struct StateFileBuffer {
  std::string fqn;
  std::string dtype;  // torch dtype name ("float32")
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  uint64_t offset = 0;  // in the payload
  uint64_t bytes = 0;
  uint64_t checksum = 0;
};

struct StateFileHeader {
  std::vector<StateFileMethod> methods;
  std::vector<StateFileBuffer> buffers;
  uint64_t payload_bytes = 0;
  int64_t positions = -1;  // pooled state: the session's length (version 2); -1: block state
  std::string attachment;  // the saver's bytes (version 3 where not empty)
};

// Writes `header` (its buffers' offsets, payload length and checksums are
// filled in here) with buffer i's bytes taken from `data[i]`. Atomic
// (atomic_file.h): on failure nothing is left behind and `path` is unchanged;
// a target that is a folder, device, FIFO or socket is refused. Throws
// kSessionFile naming the failing step.
void WriteStateFile(const std::string& path, StateFileHeader header,
                    const std::vector<const void*>& data);

// An open session file whose header has been read and checked (magic,
// version, header checksum, sizes against the file's length). Throws
// kFileNotFound or kSessionFile naming the problem.
class StateFileReader {
 public:
  explicit StateFileReader(const std::string& path);
  StateFileReader(const StateFileReader&) = delete;
  StateFileReader& operator=(const StateFileReader&) = delete;

  const StateFileHeader& header() const { return header_; }
  const std::string& path() const { return path_; }
  // Reads buffer `index` into `dst` (header().buffers[index].bytes bytes) and
  // checks its checksum; throws kSessionFile on a short read or a mismatch.
  void ReadBuffer(size_t index, void* dst);

 private:
  // Reads and checks the prefix, the header and its checksum of a file of
  // `size` bytes into header_; returns the bytes they take.
  uint64_t ReadHeader(uint64_t size);
  std::string path_;
  FileDescriptor fd_;
  uint64_t payload_start_ = 0;
  StateFileHeader header_;
};

}  // namespace aoti_sessions
