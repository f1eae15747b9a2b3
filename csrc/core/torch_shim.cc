// Run-time resolution of torch's C shim and the tensor helpers built on it.
#include "torch_shim.h"

#include <dlfcn.h>

#include <algorithm>
#include <mutex>
#include <numeric>
#include <unordered_map>

#include "errors.h"

namespace aoti_sessions {
namespace {

// dtype names as torch prints them; each resolves `aoti_torch_dtype_<name>`.
// Names a torch version lacks are skipped.
constexpr const char* kDtypeNames[] = {
    "float32", "float64",  "float16",  "bfloat16",   "int64",         "int32",
    "int16",   "int8",     "uint8",    "uint16",     "uint32",        "uint64",
    "bool",    "complex32", "complex64", "complex128", "float8_e5m2", "float8_e4m3fn",
    "float8_e5m2fnuz", "float8_e4m3fnuz",
};

void* TorchLibrary() {
  // RTLD_NOLOAD: only find the libtorch_cpu that torch (or the test binary)
  // already loaded; never load a second copy.
  static void* handle = [] {
    void* h = dlopen("libtorch_cpu.so", RTLD_NOLOAD | RTLD_LAZY);
    return h != nullptr ? h : RTLD_DEFAULT;
  }();
  return handle;
}

template <typename Fn>
void Resolve(Fn& fn, const char* name) {
  void* sym = dlsym(TorchLibrary(), name);
  if (sym == nullptr) {
    Throw(ErrorKind::kPackage,
          std::string("torch's C shim symbol ") + name +
              " was not found: import torch before aoti_sessions (C++: link libtorch_cpu)");
  }
  fn = reinterpret_cast<Fn>(sym);
}

// Device types and layouts named in messages; names this torch lacks are skipped.
constexpr const char* kDeviceTypeNames[] = {"cpu", "cuda", "meta", "xpu", "mps", "privateuse1"};
constexpr const char* kLayoutNames[] = {"strided",    "sparse_coo", "sparse_csr", "sparse_csc",
                                        "sparse_bsr", "sparse_bsc", "_mkldnn",    "jagged"};

// Names <-> codes of the shim's `aoti_torch_<prefix><name>` constants.
struct CodeTable {
  std::unordered_map<int32_t, std::string> names;
  std::unordered_map<std::string, int32_t> codes;

  template <size_t N>
  CodeTable(const char* prefix, const char* const (&names_in)[N]) {
    for (const char* name : names_in) {
      std::string symbol = std::string("aoti_torch_") + prefix + name;
      if (void* sym = dlsym(TorchLibrary(), symbol.c_str())) {
        int32_t code = reinterpret_cast<int32_t (*)()>(sym)();
        names.emplace(code, name);
        codes.emplace(name, code);
      }
    }
  }
  std::string Name(int32_t code, const char* unknown) const {
    auto it = names.find(code);
    return it != names.end() ? it->second : unknown + std::string("(") + std::to_string(code) + ")";
  }
};

const CodeTable& Dtypes() {
  static const CodeTable table("dtype_", kDtypeNames);
  return table;
}

void Check(AOTITorchError err, const char* what) {
  if (err != 0) Throw(ErrorKind::kInternal, std::string("torch shim call failed: ") + what);
}

}  // namespace

const TorchShim& Shim() {
  static TorchShim shim;
  static std::once_flag once;
  static std::string failure;
  std::call_once(once, [] {
    try {
      TorchShim s{};
      Resolve(s.delete_tensor_object, "aoti_torch_delete_tensor_object");
      Resolve(s.create_tensor_from_blob, "aoti_torch_create_tensor_from_blob");
      Resolve(s.get_data_ptr, "aoti_torch_get_data_ptr");
      Resolve(s.get_dim, "aoti_torch_get_dim");
      Resolve(s.get_sizes, "aoti_torch_get_sizes");
      Resolve(s.get_strides, "aoti_torch_get_strides");
      Resolve(s.get_storage_offset, "aoti_torch_get_storage_offset");
      Resolve(s.reinterpret_tensor, "aoti_torch__reinterpret_tensor");
      Resolve(s.get_dtype, "aoti_torch_get_dtype");
      Resolve(s.get_device_type, "aoti_torch_get_device_type");
      Resolve(s.get_device_index, "aoti_torch_get_device_index");
      Resolve(s.get_layout, "aoti_torch_get_layout");
      Resolve(s.dtype_element_size, "aoti_torch_dtype_element_size");
      Resolve(s.new_tensor_handle, "aoti_torch_new_tensor_handle");
      Resolve(s.assign_tensors, "aoti_torch_assign_tensors");
      Resolve(s.empty_strided, "aoti_torch_empty_strided");
      // CUDA-only entry points live in libtorch_cuda.
      void* cuda_lib = dlopen("libtorch_cuda.so", RTLD_NOLOAD | RTLD_LAZY);
      void* scope = cuda_lib != nullptr ? cuda_lib : RTLD_DEFAULT;
      s.create_cuda_stream_guard = reinterpret_cast<decltype(s.create_cuda_stream_guard)>(
          dlsym(scope, "aoti_torch_create_cuda_stream_guard"));
      s.delete_cuda_stream_guard = reinterpret_cast<decltype(s.delete_cuda_stream_guard)>(
          dlsym(scope, "aoti_torch_delete_cuda_stream_guard"));
      s.get_current_cuda_stream = reinterpret_cast<decltype(s.get_current_cuda_stream)>(
          dlsym(scope, "aoti_torch_get_current_cuda_stream"));
      if (s.delete_cuda_stream_guard == nullptr || s.get_current_cuda_stream == nullptr) {
        s.create_cuda_stream_guard = nullptr;
      }
      int32_t (*cpu)() = nullptr;
      int32_t (*cuda)() = nullptr;
      int32_t (*strided)() = nullptr;
      Resolve(cpu, "aoti_torch_device_type_cpu");
      Resolve(cuda, "aoti_torch_device_type_cuda");
      Resolve(strided, "aoti_torch_layout_strided");
      s.device_type_cpu = cpu();
      s.device_type_cuda = cuda();
      s.layout_strided = strided();
      shim = s;
    } catch (const Error& e) {
      failure = e.what();
    }
  });
  if (!failure.empty()) Throw(ErrorKind::kPackage, failure);
  return shim;
}

std::string DtypeName(int32_t dtype) { return Dtypes().Name(dtype, "dtype"); }

int32_t DtypeFromName(const std::string& name) {
  const auto& codes = Dtypes().codes;
  auto it = codes.find(name);
  return it != codes.end() ? it->second : -1;
}

std::string DeviceName(int32_t type, int32_t index) {
  static const CodeTable table("device_type_", kDeviceTypeNames);
  std::string name = table.Name(type, "device type");
  return type == Shim().device_type_cuda ? name + ":" + std::to_string(index) : name;
}

std::vector<int64_t> ContiguousStrides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t step = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = step;
    step *= std::max<int64_t>(sizes[i], 1);  // as torch's: a dim of size 0 steps as one of 1
  }
  return strides;
}

std::string FormatDims(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    s += (i ? ", " : "") + (dims[i] < 0 ? std::string("*") : std::to_string(dims[i]));
  }
  return s + "]";
}

int64_t TensorLayout::numel() const {
  return std::accumulate(sizes.begin(), sizes.end(), int64_t{1}, std::multiplies<>());
}

size_t TensorLayout::span_bytes() const {
  if (numel() == 0) return 0;
  int64_t last = 0;
  for (size_t i = 0; i < sizes.size(); ++i) last += (sizes[i] - 1) * strides[i];
  return static_cast<size_t>(last + 1) * Shim().dtype_element_size(dtype);
}

bool TensorLayout::dense() const {
  if (numel() == 0) return true;
  std::vector<size_t> order(sizes.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return strides[a] < strides[b]; });
  int64_t expected = 1;
  for (size_t i : order) {
    if (sizes[i] == 1) continue;
    if (strides[i] != expected) return false;
    expected *= sizes[i];
  }
  return true;
}

std::string TensorLayout::ToString() const {
  return DtypeName(dtype) + FormatDims(sizes) + " strides " + FormatDims(strides);
}

TensorLayout ReadLayout(AtenTensorHandle tensor, const std::string& what) {
  const TorchShim& s = Shim();
  static const CodeTable layouts("layout_", kLayoutNames);
  int32_t kind = 0;
  Check(s.get_layout(tensor, &kind), "get_layout");
  TensorLayout layout;
  int64_t dim = 0;
  int64_t* sizes = nullptr;
  int64_t* strides = nullptr;
  // Nested tensors are strided but have no sizes: the shim call fails.
  if (kind != s.layout_strided || s.get_sizes(tensor, &sizes) != 0) {
    Throw(ErrorKind::kTypeMismatch,
          what + " is a " + (kind != s.layout_strided ? layouts.Name(kind, "layout") : "nested") +
              " tensor; only dense (strided) tensors are supported");
  }
  Check(s.get_dtype(tensor, &layout.dtype), "get_dtype");
  Check(s.get_dim(tensor, &dim), "get_dim");
  Check(s.get_strides(tensor, &strides), "get_strides");
  layout.sizes.assign(sizes, sizes + dim);
  layout.strides.assign(strides, strides + dim);
  return layout;
}

void* DataPtr(AtenTensorHandle tensor) {
  void* data = nullptr;
  Check(Shim().get_data_ptr(tensor, &data), "get_data_ptr");
  return data;
}

int32_t DeviceType(AtenTensorHandle tensor) {
  int32_t type = 0;
  Check(Shim().get_device_type(tensor, &type), "get_device_type");
  return type;
}

int32_t DeviceIndex(AtenTensorHandle tensor) {
  int32_t index = 0;
  Check(Shim().get_device_index(tensor, &index), "get_device_index");
  return index;
}

OwnedTensor& OwnedTensor::operator=(OwnedTensor&& other) noexcept {
  if (this != &other) {
    reset();
    handle_ = other.release();
  }
  return *this;
}

void OwnedTensor::reset() {
  if (handle_ != nullptr) {
    Shim().delete_tensor_object(handle_);
    handle_ = nullptr;
  }
}

OwnedTensor OwnedTensor::Restrided(AtenTensorHandle tensor, const std::vector<int64_t>& strides) {
  const TorchShim& s = Shim();
  TensorLayout layout = ReadLayout(tensor);
  AtenTensorHandle view = nullptr;
  // The offset argument is added to the tensor's own storage offset: 0 keeps it.
  Check(s.reinterpret_tensor(tensor, static_cast<int64_t>(layout.sizes.size()), layout.sizes.data(),
                             strides.data(), 0, &view),
        "_reinterpret_tensor");
  return OwnedTensor(view);
}

OwnedTensor OwnedTensor::FirstRows(AtenTensorHandle tensor, int64_t rows) {
  const TorchShim& s = Shim();
  TensorLayout layout = ReadLayout(tensor);
  if (!layout.sizes.empty()) layout.sizes[0] = std::min(layout.sizes[0], rows);
  AtenTensorHandle view = nullptr;
  Check(s.reinterpret_tensor(tensor, static_cast<int64_t>(layout.sizes.size()), layout.sizes.data(),
                             layout.strides.data(), 0, &view),
        "_reinterpret_tensor");
  return OwnedTensor(view);
}

OwnedTensor OwnedTensor::FromBlob(void* data, const TensorLayout& layout, int32_t device_type,
                                  int32_t device_index) {
  AtenTensorHandle handle = nullptr;
  Check(Shim().create_tensor_from_blob(data, static_cast<int64_t>(layout.sizes.size()),
                                       layout.sizes.data(), layout.strides.data(), 0,
                                       layout.dtype, device_type, device_index, &handle),
        "create_tensor_from_blob");
  return OwnedTensor(handle);
}

OwnedTensor OwnedTensor::Alias(AtenTensorHandle tensor) {
  AtenTensorHandle handle = nullptr;
  Check(Shim().new_tensor_handle(tensor, &handle), "new_tensor_handle");
  return OwnedTensor(handle);
}

OwnedTensor OwnedTensor::Empty(const TensorLayout& layout, int32_t device_type,
                               int32_t device_index) {
  AtenTensorHandle handle = nullptr;
  Check(Shim().empty_strided(static_cast<int64_t>(layout.sizes.size()), layout.sizes.data(),
                             layout.strides.data(), layout.dtype, device_type, device_index,
                             &handle),
        "empty_strided");
  return OwnedTensor(handle);
}

TorchStreamScope::TorchStreamScope(void* stream, int32_t device_index) {
  const TorchShim& s = Shim();
  if (s.create_cuda_stream_guard == nullptr) return;
  void* current = nullptr;
  if (s.get_current_cuda_stream(device_index, &current) == 0 && current == stream) return;
  Check(s.create_cuda_stream_guard(stream, device_index, &guard_), "create_cuda_stream_guard");
}

TorchStreamScope::~TorchStreamScope() {
  if (guard_ != nullptr) Shim().delete_cuda_stream_guard(guard_);
}

}  // namespace aoti_sessions
