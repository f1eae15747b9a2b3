// Run-time resolution of torch's C shim and the tensor helpers built on it.
#include "torch_shim.h"

#include <dlfcn.h>

#include <algorithm>
#include <mutex>
#include <numeric>
#include <sstream>
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

struct DtypeTables {
  std::unordered_map<int32_t, std::string> names;
  std::unordered_map<std::string, int32_t> codes;
};

const DtypeTables& Dtypes() {
  static const DtypeTables tables = [] {
    DtypeTables t;
    for (const char* name : kDtypeNames) {
      std::string symbol = std::string("aoti_torch_dtype_") + name;
      if (void* sym = dlsym(TorchLibrary(), symbol.c_str())) {
        int32_t code = reinterpret_cast<int32_t (*)()>(sym)();
        t.names.emplace(code, name);
        t.codes.emplace(name, code);
      }
    }
    return t;
  }();
  return tables;
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
      Resolve(s.dtype_element_size, "aoti_torch_dtype_element_size");
      int32_t (*cpu)() = nullptr;
      int32_t (*cuda)() = nullptr;
      Resolve(cpu, "aoti_torch_device_type_cpu");
      Resolve(cuda, "aoti_torch_device_type_cuda");
      s.device_type_cpu = cpu();
      s.device_type_cuda = cuda();
      shim = s;
    } catch (const Error& e) {
      failure = e.what();
    }
  });
  if (!failure.empty()) Throw(ErrorKind::kPackage, failure);
  return shim;
}

std::string DtypeName(int32_t dtype) {
  const auto& names = Dtypes().names;
  auto it = names.find(dtype);
  return it != names.end() ? it->second : "dtype(" + std::to_string(dtype) + ")";
}

int32_t DtypeFromName(const std::string& name) {
  const auto& codes = Dtypes().codes;
  auto it = codes.find(name);
  return it != codes.end() ? it->second : -1;
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
  std::ostringstream os;
  auto list = [&os](const std::vector<int64_t>& v) {
    os << '[';
    for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
    os << ']';
  };
  os << DtypeName(dtype);
  list(sizes);
  os << " strides ";
  list(strides);
  return os.str();
}

TensorLayout ReadLayout(AtenTensorHandle tensor) {
  const TorchShim& s = Shim();
  TensorLayout layout;
  int64_t dim = 0;
  int64_t* sizes = nullptr;
  int64_t* strides = nullptr;
  Check(s.get_dtype(tensor, &layout.dtype), "get_dtype");
  Check(s.get_dim(tensor, &dim), "get_dim");
  Check(s.get_sizes(tensor, &sizes), "get_sizes");
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

OwnedTensor OwnedTensor::FromBlob(void* data, const TensorLayout& layout, int32_t device_type,
                                  int32_t device_index) {
  AtenTensorHandle handle = nullptr;
  Check(Shim().create_tensor_from_blob(data, static_cast<int64_t>(layout.sizes.size()),
                                       layout.sizes.data(), layout.strides.data(), 0,
                                       layout.dtype, device_type, device_index, &handle),
        "create_tensor_from_blob");
  return OwnedTensor(handle);
}

}  // namespace aoti_sessions
