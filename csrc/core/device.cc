// Device strings and the CPU device: plain aligned host memory.
#include "device.h"

#include <cstdlib>
#include <cstring>
#include <vector>

#include "errors.h"
#include "torch_shim.h"
#include "util.h"

namespace aoti_sessions {

#ifdef AOTI_SESSIONS_WITH_CUDA
std::unique_ptr<Device> OpenCudaDevice(const DeviceSpec& spec);  // cuda_device.cc
#endif

namespace {

constexpr size_t kAlignment = 256;

void* AlignedAlloc(size_t bytes) {
  size_t rounded = AlignUp(bytes, kAlignment);
  void* ptr = std::aligned_alloc(kAlignment, rounded == 0 ? kAlignment : rounded);
  if (ptr == nullptr) {
    Throw(ErrorKind::kDevice, "host allocation of " + std::to_string(bytes) + " bytes failed");
  }
  return ptr;
}

class CpuDevice final : public Device {
 public:
  CpuDevice() : Device(DeviceSpec{DeviceKind::kCpu, 0}) {}

  int32_t torch_device_type() const override { return Shim().device_type_cpu; }

  void* Allocate(size_t bytes, StreamHandle) override { return AlignedAlloc(bytes); }
  void Free(void* ptr, StreamHandle) override { std::free(ptr); }
  void Zero(void* dst, size_t bytes, StreamHandle) override { std::memset(dst, 0, bytes); }
  void Copy(void* dst, const void* src, size_t bytes, StreamHandle) override {
    std::memcpy(dst, src, bytes);
  }
  void Synchronize(StreamHandle) override {}
  void Order(StreamHandle, StreamHandle) override {}
};

}  // namespace

DeviceSpec DeviceSpec::Parse(const std::string& device) {
  if (device == "cpu") return DeviceSpec{DeviceKind::kCpu, 0};
  if (device == "cuda") return DeviceSpec{DeviceKind::kCuda, -1};
  const std::string prefix = "cuda:";
  if (device.compare(0, prefix.size(), prefix) == 0 && device.size() > prefix.size()) {
    std::string digits = device.substr(prefix.size());
    if (digits.size() <= 4 && digits.find_first_not_of("0123456789") == std::string::npos) {
      return DeviceSpec{DeviceKind::kCuda, std::stoi(digits)};
    }
  }
  Throw(ErrorKind::kInvalidArgument,
        "device must be 'cpu', 'cuda' or 'cuda:N', got '" + device + "'");
}

std::string DeviceSpec::ToString() const {
  if (kind == DeviceKind::kCpu) return "cpu";
  return index < 0 ? "cuda" : "cuda:" + std::to_string(index);
}

void* Device::AllocateHost(size_t bytes) { return AlignedAlloc(bytes); }

void Device::FreeHost(void* ptr) noexcept { std::free(ptr); }

void Device::NoGraphs() const {
  Throw(ErrorKind::kRun, "CUDA graphs need a CUDA device, not " + spec_.ToString());
}
void Device::BeginCapture(StreamHandle) { NoGraphs(); }
void* Device::EndCapture(StreamHandle) { NoGraphs(); }
void Device::Launch(void*, StreamHandle) { NoGraphs(); }

bool Device::IsZero(const void* src, size_t bytes, StreamHandle stream) {
  std::vector<unsigned char> host(bytes);
  Copy(host.data(), src, bytes, stream);
  Synchronize(stream);
  for (unsigned char byte : host) {
    if (byte != 0) return false;
  }
  return true;
}

void StreamTracker::Use(Device& device, StreamHandle stream) {
  MutexLock lock(mutex_);
  device.Order(last_, stream);
  last_ = stream;
}

StreamHandle StreamTracker::last() const {
  MutexLock lock(mutex_);
  return last_;
}

std::unique_ptr<Device> OpenDevice(const DeviceSpec& spec) {
  if (spec.kind == DeviceKind::kCpu) return std::make_unique<CpuDevice>();
#ifdef AOTI_SESSIONS_WITH_CUDA
  return OpenCudaDevice(spec);
#else
  Throw(ErrorKind::kInvalidArgument,
        "device '" + spec.ToString() + "' needs CUDA, but aoti_sessions was built without CUDA");
#endif
}

}  // namespace aoti_sessions
