// Weights held once per engine. Every method binds each of its weight
// constants to one held tensor per distinct (FQN, layout, content); a weight
// is loaded from a weights file straight into its own allocation, copied out
// of a container that embedded it, or adopted in place from one.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "device.h"
#include "options.h"
#include "torch_shim.h"

namespace aoti_sessions {

struct HeldWeight {
  std::string fqn;
  TensorLayout layout;
  size_t bytes = 0;
  void* data = nullptr;
  bool owned = false;   // allocated by the store (else adopted from a container)
  OwnedTensor tensor;   // what the containers are bound to
  std::string file;     // weights file and offset it was read from ("" if none)
  uint64_t file_offset = 0;
  std::vector<std::string> methods;  // methods bound to it
};

class WeightStore {
 public:
  explicit WeightStore(Device& device) : device_(device) {}
  ~WeightStore();
  WeightStore(const WeightStore&) = delete;
  WeightStore& operator=(const WeightStore&) = delete;

  // A held weight with this FQN, layout and content, or nullptr. `other`
  // (optional) is set when the FQN is held with another layout or content.
  HeldWeight* FindFile(const WeightsFile& file, const WeightEntry& entry, bool* other);
  HeldWeight* FindDevice(const std::string& fqn, const TensorLayout& layout, const void* data,
                         bool* other);
  // New held weights: read from a file, copied from device memory, or adopted
  // (the caller keeps `data` alive as long as the store).
  HeldWeight* AddFile(const WeightsFile& file, const WeightEntry& entry);
  HeldWeight* AddCopy(const std::string& fqn, const TensorLayout& layout, const void* data);
  HeldWeight* Adopt(const std::string& fqn, const TensorLayout& layout, void* data);

  // Every weight held under `fqn` (variants when methods disagree on it).
  std::vector<HeldWeight*> WithFqn(const std::string& fqn);
  const std::vector<std::unique_ptr<HeldWeight>>& all() const { return weights_; }
  size_t held_bytes() const;

  // Replaces the memory behind `weight` by `data` (owned from now on), with
  // `tensor` aliasing it, and returns the previous memory if the store owned
  // it (else nullptr).
  void* Replace(HeldWeight& weight, void* data, OwnedTensor tensor);
  // A tensor aliasing `data` with `weight`'s layout, on the store's device.
  OwnedTensor Alias(const HeldWeight& weight, void* data) const;

 private:
  HeldWeight* Add(const std::string& fqn, const TensorLayout& layout, void* data, bool owned);
  bool SameAsFile(const HeldWeight& held, const WeightsFile& file, const WeightEntry& entry);

  Device& device_;
  std::vector<std::unique_ptr<HeldWeight>> weights_;
};

// Reads `bytes` at `offset` of the file at `path` into host memory; throws
// kPackage naming the file on a short or failed read.
void ReadFileRange(const std::string& path, uint64_t offset, size_t bytes, void* dst);
// Reads a file range into device memory (through bounded host staging on a GPU).
void ReadFileToDevice(Device& device, const std::string& path, uint64_t offset, size_t bytes,
                      void* dst);
// Whether two ranges of device memory (or device vs host `host_b`) hold the
// same bytes (synchronous; load time only).
bool DeviceBytesEqual(Device& device, const void* a, const void* b, size_t bytes);

}  // namespace aoti_sessions
