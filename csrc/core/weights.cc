// Weights held once per engine: file loading, content identity, ownership.
#include "weights.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "errors.h"
#include "posix_file.h"

namespace aoti_sessions {
namespace {

constexpr size_t kChunk = size_t{16} << 20;  // host staging per step

// A weights file open for reading; every read must be complete (kPackage).
class File {
 public:
  explicit File(const std::string& path)
      : path_(path), fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {
    if (!fd_.valid()) {
      Throw(ErrorKind::kPackage, "cannot open weights file " + path + ": " + ErrnoText(errno));
    }
  }

  void Read(uint64_t offset, size_t bytes, void* dst) const {
    int64_t n = ReadAt(fd_.get(), dst, bytes, offset);
    if (n != static_cast<int64_t>(bytes)) {
      Throw(ErrorKind::kPackage, "weights file " + path_ + " is truncated or unreadable at byte " +
                                     std::to_string(offset + (n < 0 ? 0 : n)) +
                                     (n < 0 ? ": " + ErrnoText(errno) : ""));
    }
  }

 private:
  std::string path_;
  FileDescriptor fd_;
};

}  // namespace

void ReadFileRange(const std::string& path, uint64_t offset, size_t bytes, void* dst) {
  File(path).Read(offset, bytes, dst);
}

void ReadFileToDevice(Device& device, const std::string& path, uint64_t offset, size_t bytes,
                      void* dst) {
  File file(path);
  if (device.spec().kind == DeviceKind::kCpu) {
    file.Read(offset, bytes, dst);
    return;
  }
  std::vector<char> staging(std::min(bytes, kChunk));
  for (size_t done = 0; done < bytes;) {
    size_t n = std::min(kChunk, bytes - done);
    file.Read(offset + done, n, staging.data());
    device.Copy(static_cast<char*>(dst) + done, staging.data(), n, nullptr);
    device.Synchronize(nullptr);  // the staging buffer is reused
    done += n;
  }
}

namespace {

// Compares `bytes` chunk by chunk: `fill(offset, n, a, b)` puts the two sides'
// next n bytes into host buffers a and b.
template <typename Fill>
bool ChunksEqual(size_t bytes, Fill fill) {
  std::vector<char> a(std::min(bytes, kChunk)), b(a.size());
  for (size_t done = 0; done < bytes;) {
    size_t n = std::min(kChunk, bytes - done);
    fill(done, n, a.data(), b.data());
    if (std::memcmp(a.data(), b.data(), n) != 0) return false;
    done += n;
  }
  return true;
}

}  // namespace

bool DeviceBytesEqual(Device& device, const void* a, const void* b, size_t bytes) {
  if (device.spec().kind == DeviceKind::kCpu) return std::memcmp(a, b, bytes) == 0;
  return ChunksEqual(bytes, [&](size_t at, size_t n, char* ha, char* hb) {
    device.Copy(ha, static_cast<const char*>(a) + at, n, nullptr);
    device.Copy(hb, static_cast<const char*>(b) + at, n, nullptr);
    device.Synchronize(nullptr);
  });
}

WeightStore::~WeightStore() {
  for (auto& w : weights_) {
    w->tensor.reset();
    if (w->owned && w->data != nullptr) {
      try {
        device_.Free(w->data, nullptr);
      } catch (...) {
        // Teardown must not throw.
      }
    }
  }
}

HeldWeight* WeightStore::Add(const std::string& fqn, const TensorLayout& layout, void* data,
                             bool owned) {
  auto w = std::make_unique<HeldWeight>();
  w->fqn = fqn;
  w->layout = layout;
  w->bytes = layout.span_bytes();
  w->data = data;
  w->owned = owned;
  w->tensor = OwnedTensor::FromBlob(data, layout, device_.torch_device_type(), device_.spec().index);
  weights_.push_back(std::move(w));
  return weights_.back().get();
}

HeldWeight* WeightStore::AddFile(const WeightsFile& file, const WeightEntry& entry) {
  if (entry.bytes != entry.layout.span_bytes()) {
    Throw(ErrorKind::kPackage, "weights file " + file.path + ": entry '" + entry.fqn + "' holds " +
                                   std::to_string(entry.bytes) + " bytes, but its layout " +
                                   entry.layout.ToString() + " spans " +
                                   std::to_string(entry.layout.span_bytes()));
  }
  void* data = device_.Allocate(entry.bytes, nullptr);
  try {
    ReadFileToDevice(device_, file.path, entry.offset, entry.bytes, data);
    HeldWeight* w = Add(entry.fqn, entry.layout, data, true);
    w->file = file.path;
    w->file_offset = entry.offset;
    return w;
  } catch (...) {
    device_.Free(data, nullptr);
    throw;
  }
}

HeldWeight* WeightStore::AddCopy(const std::string& fqn, const TensorLayout& layout,
                                 const void* src) {
  size_t bytes = layout.span_bytes();
  void* data = device_.Allocate(bytes, nullptr);
  try {
    device_.Copy(data, src, bytes, nullptr);
    device_.Synchronize(nullptr);
    return Add(fqn, layout, data, true);
  } catch (...) {
    device_.Free(data, nullptr);
    throw;
  }
}

HeldWeight* WeightStore::Adopt(const std::string& fqn, const TensorLayout& layout, void* data) {
  return Add(fqn, layout, data, false);
}

std::vector<HeldWeight*> WeightStore::WithFqn(const std::string& fqn) {
  std::vector<HeldWeight*> out;
  for (auto& w : weights_) {
    if (w->fqn == fqn) out.push_back(w.get());
  }
  return out;
}

bool WeightStore::SameAsFile(const HeldWeight& held, const WeightsFile& file,
                             const WeightEntry& entry) {
  if (held.file == file.path && held.file_offset == entry.offset) return true;
  File source(file.path);
  return ChunksEqual(entry.bytes, [&](size_t at, size_t n, char* from_file, char* from_held) {
    source.Read(entry.offset + at, n, from_file);
    device_.Copy(from_held, static_cast<const char*>(held.data) + at, n, nullptr);
    device_.Synchronize(nullptr);
  });
}

HeldWeight* WeightStore::FindFile(const WeightsFile& file, const WeightEntry& entry, bool* other) {
  for (HeldWeight* w : WithFqn(entry.fqn)) {
    if (w->layout == entry.layout && SameAsFile(*w, file, entry)) return w;
    if (other) *other = true;
  }
  return nullptr;
}

HeldWeight* WeightStore::FindDevice(const std::string& fqn, const TensorLayout& layout,
                                    const void* data, bool* other) {
  for (HeldWeight* w : WithFqn(fqn)) {
    if (w->layout == layout && (w->data == data || DeviceBytesEqual(device_, w->data, data, w->bytes))) {
      return w;
    }
    if (other) *other = true;
  }
  return nullptr;
}

size_t WeightStore::held_bytes() const {
  size_t total = 0;
  for (const auto& w : weights_) total += w->bytes;
  return total;
}

OwnedTensor WeightStore::Alias(const HeldWeight& weight, void* data) const {
  return OwnedTensor::FromBlob(data, weight.layout, device_.torch_device_type(),
                               device_.spec().index);
}

void* WeightStore::Replace(HeldWeight& weight, void* data, OwnedTensor tensor) {
  void* previous = weight.owned ? weight.data : nullptr;
  weight.tensor = std::move(tensor);
  weight.data = data;
  weight.owned = true;
  weight.file.clear();
  return previous;
}

}  // namespace aoti_sessions
