// torch's `aoti_torch_*` C shim, resolved at run time from the libtorch_cpu
// already loaded in the process, plus the small tensor vocabulary the core uses
// on top of it: an owning handle and a tensor layout.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "aoti_abi.h"

namespace aoti_sessions {

// Function table of the shim. Every entry is required unless marked optional;
// Shim() throws a kPackage Error naming the first missing symbol.
struct TorchShim {
  AOTITorchError (*delete_tensor_object)(AtenTensorHandle);
  AOTITorchError (*create_tensor_from_blob)(void*, int64_t, const int64_t*, const int64_t*,
                                            int64_t, int32_t, int32_t, int32_t,
                                            AtenTensorHandle*);
  AOTITorchError (*get_data_ptr)(AtenTensorHandle, void**);
  AOTITorchError (*get_dim)(AtenTensorHandle, int64_t*);
  AOTITorchError (*get_sizes)(AtenTensorHandle, int64_t**);
  AOTITorchError (*get_strides)(AtenTensorHandle, int64_t**);
  AOTITorchError (*get_storage_offset)(AtenTensorHandle, int64_t*);
  AOTITorchError (*reinterpret_tensor)(AtenTensorHandle, int64_t, const int64_t*, const int64_t*,
                                       int64_t, AtenTensorHandle*);
  AOTITorchError (*get_dtype)(AtenTensorHandle, int32_t*);
  AOTITorchError (*get_device_type)(AtenTensorHandle, int32_t*);
  AOTITorchError (*get_device_index)(AtenTensorHandle, int32_t*);
  AOTITorchError (*get_layout)(AtenTensorHandle, int32_t*);
  size_t (*dtype_element_size)(int32_t);
  AOTITorchError (*new_tensor_handle)(AtenTensorHandle, AtenTensorHandle*);
  // *dst = *src: dst becomes another reference to src's tensor.
  AOTITorchError (*assign_tensors)(AtenTensorHandle src, AtenTensorHandle dst);
  AOTITorchError (*empty_strided)(int64_t, const int64_t*, const int64_t*, int32_t, int32_t,
                                  int32_t, AtenTensorHandle*);
  // Optional (nullptr without libtorch_cuda): make a stream torch's current
  // CUDA stream for a scope.
  AOTITorchError (*create_cuda_stream_guard)(void*, int32_t, void**);
  AOTITorchError (*delete_cuda_stream_guard)(void*);
  AOTITorchError (*get_current_cuda_stream)(int32_t, void**);
  int32_t device_type_cpu;
  int32_t device_type_cuda;
  int32_t layout_strided;
};

// The process's shim, resolved once (thread-safe). Looks in an already loaded
// libtorch_cpu.so first (Python: `import torch` loads it), then the global scope.
const TorchShim& Shim();

// torch's name of a dtype code ("float32", "int64", ...), or "dtype(<code>)".
std::string DtypeName(int32_t dtype);
// Code of a dtype name as torch prints it, without "torch."; -1 if unknown.
int32_t DtypeFromName(const std::string& name);
// "cpu", "cuda:1", "meta", ... for a device type code and index.
std::string DeviceName(int32_t type, int32_t index);
// "[2, 4, *]": dimensions as in messages, "*" for a negative (dynamic) one.
std::string FormatDims(const std::vector<int64_t>& dims);

// The strides of a contiguous tensor of `sizes`.
std::vector<int64_t> ContiguousStrides(const std::vector<int64_t>& sizes);

// Sizes, strides and dtype of a tensor: what must agree for two tensors to be
// interchangeable as a container constant.
struct TensorLayout {
  int32_t dtype = 0;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;

  int64_t numel() const;
  // Bytes of the smallest storage the layout addresses (0 for empty tensors).
  size_t span_bytes() const;
  // True when the layout covers its span exactly once (contiguous up to a
  // permutation of dimensions), so its bytes can be copied as one block.
  bool dense() const;
  bool operator==(const TensorLayout& o) const {
    return dtype == o.dtype && sizes == o.sizes && strides == o.strides;
  }
  bool operator!=(const TensorLayout& o) const { return !(*this == o); }
  // e.g. "float32[2, 4, 128, 16] strides [8192, 2048, 16, 1]".
  std::string ToString() const;
};

// Reads a tensor's layout through the shim. Sparse and nested tensors have
// none: kTypeMismatch, "`what` is a sparse_coo tensor ...". Any other failing
// shim call is kInternal.
TensorLayout ReadLayout(AtenTensorHandle tensor, const std::string& what = "tensor");
void* DataPtr(AtenTensorHandle tensor);
int32_t DeviceType(AtenTensorHandle tensor);
int32_t DeviceIndex(AtenTensorHandle tensor);

// Unique owner of an AtenTensorHandle: deletes it through the shim.
class OwnedTensor {
 public:
  OwnedTensor() = default;
  explicit OwnedTensor(AtenTensorHandle handle) : handle_(handle) {}
  OwnedTensor(const OwnedTensor&) = delete;
  OwnedTensor& operator=(const OwnedTensor&) = delete;
  OwnedTensor(OwnedTensor&& other) noexcept : handle_(other.release()) {}
  OwnedTensor& operator=(OwnedTensor&& other) noexcept;
  ~OwnedTensor() { reset(); }

  AtenTensorHandle get() const { return handle_; }
  AtenTensorHandle release() {
    AtenTensorHandle h = handle_;
    handle_ = nullptr;
    return h;
  }
  void reset();
  explicit operator bool() const { return handle_ != nullptr; }

  // A view of `tensor`'s storage with the same sizes and offset but `strides`
  // (keeps the storage alive).
  static OwnedTensor Restrided(AtenTensorHandle tensor, const std::vector<int64_t>& strides);

  // A view of the first `rows` rows (along dimension 0) of `tensor`.
  static OwnedTensor FirstRows(AtenTensorHandle tensor, int64_t rows);
  // A second handle to `tensor` (same storage, kept alive by either).
  static OwnedTensor Alias(AtenTensorHandle tensor);
  // A new tensor from torch's allocator (for torch's current stream on CUDA).
  static OwnedTensor Empty(const TensorLayout& layout, int32_t device_type, int32_t device_index);
  // A tensor aliasing `data` (not owning it) with the given layout and device.
  static OwnedTensor FromBlob(void* data, const TensorLayout& layout, int32_t device_type,
                              int32_t device_index);

 private:
  AtenTensorHandle handle_ = nullptr;
};

// Makes `stream` torch's current CUDA stream on the calling thread for a
// scope, so that what torch allocates meanwhile is ordered on it (as the
// model's own run does). A no-op where it is current already, or where the
// shim has no stream guard.
class TorchStreamScope {
 public:
  TorchStreamScope(void* stream, int32_t device_index);
  ~TorchStreamScope();
  TorchStreamScope(const TorchStreamScope&) = delete;
  TorchStreamScope& operator=(const TorchStreamScope&) = delete;

 private:
  void* guard_ = nullptr;
};

}  // namespace aoti_sessions
