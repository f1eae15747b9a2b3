// Session file encoding, atomic writing and checked reading.
#include "state_file.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "atomic_file.h"
#include "checksum.h"
#include "errors.h"
#include "util.h"

namespace aoti_sessions {
namespace {

constexpr char kMagic[8] = {'A', 'I', 'S', 'S', 'T', 'A', 'T', 'E'};
constexpr uint64_t kAlign = 64;
constexpr size_t kPrefix = 24;  // magic, version, reserved, header length
// A header longer than this is not one of ours (a buffer is ~100 bytes).
constexpr uint64_t kMaxHeader = 64ull << 20;

uint64_t Aligned(uint64_t n) { return AlignUp(n, kAlign); }

class Encoder {
 public:
  template <typename T>
  void Put(T v) {
    const auto* p = reinterpret_cast<const char*>(&v);
    out_.append(p, sizeof v);
  }
  void PutString(const std::string& s) {
    Put(static_cast<uint32_t>(s.size()));
    out_ += s;
  }
  std::string& bytes() { return out_; }

 private:
  std::string out_;
};

class Decoder {
 public:
  Decoder(const std::string& in, const std::string& path) : in_(in), path_(path) {}
  template <typename T>
  T Get() {
    Need(sizeof(T));
    T v;
    std::memcpy(&v, in_.data() + pos_, sizeof v);
    pos_ += sizeof v;
    return v;
  }
  std::string GetString() {
    auto n = Get<uint32_t>();
    Need(n);
    std::string s = in_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  uint32_t GetCount(size_t min_item_bytes) {
    auto n = Get<uint32_t>();
    if (static_cast<uint64_t>(n) * min_item_bytes > in_.size() - pos_) Malformed();
    return n;
  }
  bool done() const { return pos_ == in_.size(); }
  [[noreturn]] void Malformed() const {
    Throw(ErrorKind::kSessionFile, "session file " + path_ + " has a malformed header");
  }

 private:
  void Need(size_t n) const {
    if (n > in_.size() - pos_) Malformed();
  }
  const std::string& in_;
  const std::string& path_;
  size_t pos_ = 0;
};

std::string EncodeHeader(const StateFileHeader& h) {
  Encoder e;
  e.Put(h.payload_bytes);
  e.Put(static_cast<uint32_t>(h.methods.size()));
  for (const StateFileMethod& m : h.methods) {
    e.PutString(m.name);
    e.Put(m.library_hash);
    e.Put(m.weights_hash);
  }
  e.Put(static_cast<uint32_t>(h.buffers.size()));
  for (const StateFileBuffer& b : h.buffers) {
    e.PutString(b.fqn);
    e.PutString(b.dtype);
    e.Put(static_cast<uint32_t>(b.sizes.size()));
    for (int64_t s : b.sizes) e.Put(s);
    for (int64_t s : b.strides) e.Put(s);
    e.Put(b.offset);
    e.Put(b.bytes);
    e.Put(b.checksum);
  }
  if (!h.attachment.empty()) {
    e.Put(h.positions);
    e.PutString(h.attachment);
  } else if (h.positions >= 0) {
    e.Put(h.positions);
  }
  return std::move(e.bytes());
}

StateFileHeader DecodeHeader(const std::string& in, const std::string& path, uint32_t version) {
  Decoder d(in, path);
  StateFileHeader h;
  h.payload_bytes = d.Get<uint64_t>();
  uint32_t methods = d.GetCount(20);
  for (uint32_t i = 0; i < methods; ++i) {
    StateFileMethod m;
    m.name = d.GetString();
    m.library_hash = d.Get<uint64_t>();
    m.weights_hash = d.Get<uint64_t>();
    h.methods.push_back(std::move(m));
  }
  uint32_t buffers = d.GetCount(36);
  for (uint32_t i = 0; i < buffers; ++i) {
    StateFileBuffer b;
    b.fqn = d.GetString();
    b.dtype = d.GetString();
    uint32_t rank = d.GetCount(16);
    for (uint32_t k = 0; k < rank; ++k) b.sizes.push_back(d.Get<int64_t>());
    for (uint32_t k = 0; k < rank; ++k) b.strides.push_back(d.Get<int64_t>());
    b.offset = d.Get<uint64_t>();
    b.bytes = d.Get<uint64_t>();
    b.checksum = d.Get<uint64_t>();
    if (b.offset > h.payload_bytes || b.bytes > h.payload_bytes - b.offset) d.Malformed();
    h.buffers.push_back(std::move(b));
  }
  if (version == kPooledStateFileVersion) {
    h.positions = d.Get<int64_t>();
    if (h.positions < 0) d.Malformed();
  } else if (version == kAttachedStateFileVersion) {
    h.positions = d.Get<int64_t>();
    if (h.positions < -1) d.Malformed();
    h.attachment = d.GetString();
    if (h.attachment.empty() || h.attachment.size() > kMaxAttachment) d.Malformed();
  }
  if (!d.done()) d.Malformed();
  return h;
}

// Reads exactly `bytes` at `offset`; false on a short read (end of file).
bool ReadExactly(int fd, void* dst, size_t bytes, uint64_t offset, const std::string& path) {
  int64_t n = ReadAt(fd, dst, bytes, offset);
  if (n < 0) Throw(ErrorKind::kSessionFile, "reading " + path + " failed: " + ErrnoText(errno));
  return static_cast<size_t>(n) == bytes;
}

}  // namespace

void WriteStateFile(const std::string& path, StateFileHeader header,
                    const std::vector<const void*>& data) {
  if (data.size() != header.buffers.size()) {
    Throw(ErrorKind::kInternal, "WriteStateFile: data and buffers differ in number");
  }
  uint64_t offset = 0;
  for (size_t i = 0; i < header.buffers.size(); ++i) {
    StateFileBuffer& b = header.buffers[i];
    b.offset = offset;
    b.checksum = Checksum64(data[i], b.bytes);
    offset = Aligned(offset + b.bytes);
  }
  header.payload_bytes = offset;
  if (header.attachment.size() > kMaxAttachment) {
    Throw(ErrorKind::kInvalidArgument, "a session file's attachment holds at most " +
                                           std::to_string(kMaxAttachment) + " bytes, got " +
                                           std::to_string(header.attachment.size()));
  }
  std::string encoded = EncodeHeader(header);
  std::string head(kPrefix, '\0');
  std::memcpy(&head[0], kMagic, sizeof kMagic);
  const uint32_t version = !header.attachment.empty() ? kAttachedStateFileVersion
                           : header.positions >= 0  ? kPooledStateFileVersion
                                                    : kStateFileVersion;
  std::memcpy(&head[8], &version, sizeof version);
  uint64_t length = encoded.size();
  std::memcpy(&head[16], &length, sizeof length);
  head += encoded;
  uint64_t checksum = Checksum64(head.data(), head.size());
  head.append(reinterpret_cast<const char*>(&checksum), sizeof checksum);
  head.resize(Aligned(head.size()), '\0');

  AtomicFileWriter file(path, std::string(kMagic, sizeof kMagic), ErrorKind::kSessionFile);
  file.Write(head.data(), head.size());
  static const char zeros[kAlign] = {};
  uint64_t written = 0;
  for (size_t i = 0; i < header.buffers.size(); ++i) {
    const StateFileBuffer& b = header.buffers[i];
    file.Write(zeros, b.offset - written);
    file.Write(data[i], b.bytes);
    written = b.offset + b.bytes;
  }
  file.Write(zeros, header.payload_bytes - written);
  file.Commit();
}

StateFileReader::StateFileReader(const std::string& path) : path_(path) {
  // Non-blocking: opening a FIFO must not hang (only regular files pass below).
  fd_ = FileDescriptor(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (!fd_.valid()) {
    ErrorKind kind = errno == ENOENT ? ErrorKind::kFileNotFound : ErrorKind::kSessionFile;
    Throw(kind, "cannot open session file " + path + ": " + ErrnoText(errno));
  }
  struct stat st {};
  if (::fstat(fd_.get(), &st) != 0) {
    Throw(ErrorKind::kSessionFile, "cannot stat " + path + ": " + ErrnoText(errno));
  }
  if (S_ISDIR(st.st_mode)) Throw(ErrorKind::kSessionFile, path + " is a folder, not a session file");
  if (!S_ISREG(st.st_mode)) {
    Throw(ErrorKind::kSessionFile, path + " is not a regular file, so not a session file");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  const uint64_t head_bytes = ReadHeader(size);
  payload_start_ = Aligned(head_bytes);
  // Compared without forming payload_start_ + payload_bytes (it could wrap).
  if (header_.payload_bytes > size || size - header_.payload_bytes < payload_start_) {
    std::string want = header_.payload_bytes > UINT64_MAX - payload_start_
                           ? std::string("more than 2^64")
                           : std::to_string(payload_start_ + header_.payload_bytes);
    Throw(ErrorKind::kSessionFile, "session file " + path + " is truncated: " +
                                       std::to_string(size) + " bytes, its header says " + want);
  }
  if (size - header_.payload_bytes > payload_start_) {
    Throw(ErrorKind::kSessionFile, "session file " + path + " has " +
                                       std::to_string(size - header_.payload_bytes - payload_start_) +
                                       " unexpected bytes after its payload");
  }
}

uint64_t StateFileReader::ReadHeader(uint64_t size) {
  const std::string& path = path_;
  char prefix[kPrefix];
  if (size == 0) Throw(ErrorKind::kSessionFile, path + " is empty, not a session file");
  const size_t got = static_cast<size_t>(std::min<uint64_t>(size, kPrefix));
  if (!ReadExactly(fd_.get(), prefix, got, 0, path) ||
      std::memcmp(prefix, kMagic, std::min(got, sizeof kMagic)) != 0) {
    Throw(ErrorKind::kSessionFile, path + " is not an aoti_sessions session file (bad magic)");
  }
  if (got < kPrefix) {  // starts as a session file does, and ends before its first field
    Throw(ErrorKind::kSessionFile, "session file " + path + " is truncated (" +
                                       std::to_string(size) + " bytes)");
  }
  uint32_t version = 0;
  std::memcpy(&version, prefix + 8, sizeof version);
  if (version < kStateFileVersion || version > kAttachedStateFileVersion) {
    Throw(ErrorKind::kSessionFile, "session file " + path + " has format version " +
                                       std::to_string(version) + "; this build reads versions " +
                                       std::to_string(kStateFileVersion) + " to " +
                                       std::to_string(kAttachedStateFileVersion));
  }
  uint64_t length = 0;
  std::memcpy(&length, prefix + 16, sizeof length);
  if (length > kMaxHeader) {
    Throw(ErrorKind::kSessionFile, "session file " + path + " has a malformed header (length " +
                                       std::to_string(length) + ")");
  }
  if (kPrefix + length + 8 > size) {
    Throw(ErrorKind::kSessionFile, "session file " + path + " is truncated (" +
                                       std::to_string(size) + " bytes, shorter than its header)");
  }
  std::string head(kPrefix + length, '\0');
  uint64_t stored = 0;
  if (!ReadExactly(fd_.get(), &head[0], head.size(), 0, path) ||
      !ReadExactly(fd_.get(), &stored, sizeof stored, head.size(), path)) {
    Throw(ErrorKind::kSessionFile, "session file " + path + " is truncated");
  }
  if (Checksum64(head.data(), head.size()) != stored) {
    Throw(ErrorKind::kSessionFile, "session file " + path + " is corrupted (header checksum mismatch)");
  }
  header_ = DecodeHeader(head.substr(kPrefix), path, version);
  return head.size() + sizeof stored;
}

void StateFileReader::ReadBuffer(size_t index, void* dst) {
  if (index >= header_.buffers.size()) {
    Throw(ErrorKind::kInternal, "session file buffer " + std::to_string(index) + " out of range");
  }
  const StateFileBuffer& b = header_.buffers[index];
  if (!ReadExactly(fd_.get(), dst, b.bytes, payload_start_ + b.offset, path_)) {
    Throw(ErrorKind::kSessionFile, "session file " + path_ + " is truncated (in buffer '" +
                                       b.fqn + "')");
  }
  if (Checksum64(dst, b.bytes) != b.checksum) {
    Throw(ErrorKind::kSessionFile, "session file " + path_ + " is corrupted: buffer '" + b.fqn +
                                       "' fails its checksum");
  }
}

}  // namespace aoti_sessions
