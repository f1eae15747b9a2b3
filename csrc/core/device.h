// Where session state lives: memory allocation, copies and fills on one device,
// ordered on a stream. The engine only talks to this interface, so CPU and CUDA
// share every other line of the core.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "mutex.h"

namespace aoti_sessions {

enum class DeviceKind { kCpu, kCuda };

// A parsed device string: "cpu", "cuda", "cuda:N".
struct DeviceSpec {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;  // -1 for "cuda" without an index until resolved

  // Throws kInvalidArgument for anything else than the forms above.
  static DeviceSpec Parse(const std::string& device);
  std::string ToString() const;
};

// Stream handle of the device runtime (cudaStream_t on CUDA; unused on CPU).
using StreamHandle = void*;

class Device {
 public:
  virtual ~Device() = default;

  const DeviceSpec& spec() const { return spec_; }
  // The shim's device-type code for tensors on this device.
  virtual int32_t torch_device_type() const = 0;

  // Allocates `bytes` (aligned to at least 256 bytes), usable in the order of
  // `stream` (on CUDA, stream-ordered from a private pool). Throws kDevice on
  // failure with the runtime's message; nothing stays allocated.
  virtual void* Allocate(size_t bytes, StreamHandle stream) = 0;
  // Frees `ptr` once the work queued on `stream` so far has finished, without
  // blocking the host.
  virtual void Free(void* ptr, StreamHandle stream) = 0;
  // Host memory that copies to and from the device run at full speed (CUDA:
  // pinned); the second tier of session state. Throws kDevice on failure.
  virtual void* AllocateHost(size_t bytes);
  // Frees AllocateHost memory; no work may be queued on it any more.
  virtual void FreeHost(void* ptr) noexcept;
  // Queues `dst[0:bytes] = 0` on `stream`.
  virtual void Zero(void* dst, size_t bytes, StreamHandle stream) = 0;
  // Queues a copy on `stream`; either side may be host or device memory.
  virtual void Copy(void* dst, const void* src, size_t bytes, StreamHandle stream) = 0;
  // Blocks the host until `stream` has finished its queued work.
  virtual void Synchronize(StreamHandle stream) = 0;
  // Makes work queued on `to` from now on wait for the work queued on `from`
  // so far (no-op when they are the same stream, and on the CPU).
  virtual void Order(StreamHandle from, StreamHandle to) = 0;
  // Lets the device hold up to `bytes` of memory, in use or freed, instead of
  // returning freed memory at once (CUDA: the pool's release threshold), so
  // that a session created after one closed maps no fresh memory. A hint:
  // never throws. No-op on the CPU.
  virtual void Retain(size_t /*bytes*/) noexcept {}
  // Makes the device current on the calling thread (a thread that never used
  // CUDA has no context, and model kernels launch through the driver API);
  // returns what Leave needs to restore the caller's device. No-op on the CPU.
  virtual int Enter() { return 0; }
  virtual void Leave(int /*previous*/) noexcept {}
  // CUDA graphs (docs/aoti-runtime.md). Whether this device can capture work
  // queued on a stream into a graph and replay it.
  virtual bool supports_graphs() const { return false; }
  // A stream on which the work of `stream` can be captured: `stream` itself,
  // or, for the legacy default stream (which cannot be captured), a private
  // stream of the device, shared by every caller (captures on it must be
  // serialised). A graph captured on either replays on `stream`.
  virtual StreamHandle CaptureStream(StreamHandle stream) { return stream; }
  // Starts capturing the work the calling thread queues on `stream` (other
  // threads go on running). Throws kRun if the stream cannot be captured.
  virtual void BeginCapture(StreamHandle stream);
  // Ends the capture and returns the instantiated graph (an executable graph
  // of the device runtime), or throws kRun with the runtime's reason (e.g. a
  // host synchronisation inside the capture); the stream is out of capture
  // mode either way.
  virtual void* EndCapture(StreamHandle stream);
  // Ends a capture that failed part-way, discarding it; the stream leaves
  // capture mode. Never throws.
  virtual void AbortCapture(StreamHandle /*stream*/) noexcept {}
  // Queues one replay of `graph` on `stream`.
  virtual void Launch(void* graph, StreamHandle stream);
  // Destroys `graph`; a replay in flight finishes first (the runtime defers it).
  virtual void DestroyGraph(void* /*graph*/) noexcept {}
  // Whether `bytes` of device memory at `src` are all zero (synchronous; load time only).
  bool IsZero(const void* src, size_t bytes, StreamHandle stream);

 protected:
  explicit Device(DeviceSpec spec) : spec_(spec) {}
  // What the graph calls of a device without graphs do: throw kRun.
  [[noreturn]] void NoGraphs() const;
  DeviceSpec spec_;
};

// Makes a device current on the calling thread for a scope (Device::Enter).
class DeviceScope {
 public:
  explicit DeviceScope(Device& device) : device_(device), previous_(device.Enter()) {}
  ~DeviceScope() { device_.Leave(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  Device& device_;
  int previous_;
};

// The stream that last queued work on some memory. Using the memory on another
// stream first orders that stream after the last one, so all uses form one
// sequence and the memory can be freed on the last stream. Thread-safe: its
// lock is a leaf (nothing is taken under it).
class StreamTracker {
 public:
  explicit StreamTracker(StreamHandle first = nullptr) : last_(first) {}
  // Orders `stream` after the previous user's stream; `stream` becomes the last.
  void Use(Device& device, StreamHandle stream);
  StreamHandle last() const;

 private:
  mutable Mutex mutex_;
  StreamHandle last_ GUARDED_BY(mutex_);
};

// Opens the device. CUDA devices need a build with CUDA support; a build
// without it throws kInvalidArgument saying so.
std::unique_ptr<Device> OpenDevice(const DeviceSpec& spec);

}  // namespace aoti_sessions
