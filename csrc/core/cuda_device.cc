// The CUDA device: session memory from a private stream-ordered pool
// (cudaMallocFromPoolAsync / cudaFreeAsync), so that a closed session's memory
// is released after the work that used it, without blocking the host or other
// streams, and copies / fills queued on the caller's stream. Every call runs
// under a device guard and turns a CUDA failure into an Error of kind kDevice
// carrying the CUDA error string.
#include <cuda_runtime_api.h>

#include <mutex>
#include <shared_mutex>
#include <string>

#include "device.h"
#include "errors.h"
#include "torch_shim.h"

namespace aoti_sessions {
namespace {

void Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so later calls start clean
  Throw(ErrorKind::kDevice, std::string(what) + " failed: " + cudaGetErrorString(err) + " (" +
                                cudaGetErrorName(err) + ")");
}

cudaStream_t ToCuda(StreamHandle stream) { return static_cast<cudaStream_t>(stream); }

// Makes `device` current for the scope, restoring the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    Check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device_) Check(cudaSetDevice(device_), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int previous_ = 0;
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(const DeviceSpec& spec) : Device(spec) {
    int count = 0;
    Check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
    if (spec_.index < 0) Check(cudaGetDevice(&spec_.index), "cudaGetDevice");
    if (spec_.index >= count) {
      Throw(ErrorKind::kInvalidArgument, "device " + spec_.ToString() + " does not exist: " +
                                             std::to_string(count) + " CUDA devices");
    }
    DeviceGuard guard(spec_.index);
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = spec_.index;
    Check(cudaMemPoolCreate(&pool_, &props), "cudaMemPoolCreate");
    // Release freed memory to the device at the next synchronisation, until
    // the engine says how much it may keep (Retain).
    uint64_t threshold = 0;
    cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold);
  }

  void Retain(size_t bytes) noexcept override {
    // The threshold counts all reserved memory, in use or not; it is applied
    // at the next synchronisation. A failure only means memory goes back early.
    uint64_t threshold = bytes;
    if (cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold) !=
        cudaSuccess) {
      cudaGetLastError();
    }
  }

  ~CudaDevice() override {
    // No throwing guard here: teardown must survive a broken CUDA context.
    int previous = 0;
    bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != spec_.index &&
                    cudaSetDevice(spec_.index) == cudaSuccess;
    cudaMemPoolDestroy(pool_);
    if (capture_stream_ != nullptr) cudaStreamDestroy(capture_stream_);
    if (switched) cudaSetDevice(previous);
  }

  int Enter() override {
    int previous = 0;
    Check(cudaGetDevice(&previous), "cudaGetDevice");
    // cudaSetDevice also binds the primary context to a thread that has none.
    Check(cudaSetDevice(spec_.index), "cudaSetDevice");
    return previous;
  }
  void Leave(int previous) noexcept override {
    if (previous != spec_.index) cudaSetDevice(previous);
  }

  int32_t torch_device_type() const override { return Shim().device_type_cuda; }

  void* Allocate(size_t bytes, StreamHandle stream) override {
    DeviceGuard guard(spec_.index);
    void* ptr = nullptr;
    Check(cudaMallocFromPoolAsync(&ptr, bytes == 0 ? 1 : bytes, pool_, ToCuda(stream)),
          ("allocating " + std::to_string(bytes) + " bytes on " + spec_.ToString()).c_str());
    return ptr;
  }

  void Free(void* ptr, StreamHandle stream) override {
    DeviceGuard guard(spec_.index);
    Check(cudaFreeAsync(ptr, ToCuda(stream)), "cudaFreeAsync");
  }

  void* AllocateHost(size_t bytes) override {
    DeviceGuard guard(spec_.index);
    void* ptr = nullptr;
    Check(cudaHostAlloc(&ptr, bytes == 0 ? 1 : bytes, cudaHostAllocPortable),
          ("allocating " + std::to_string(bytes) + " bytes of pinned host memory").c_str());
    return ptr;
  }

  void FreeHost(void* ptr) noexcept override {
    if (cudaFreeHost(ptr) != cudaSuccess) cudaGetLastError();
  }

  void Zero(void* dst, size_t bytes, StreamHandle stream) override {
    DeviceGuard guard(spec_.index);
    Check(cudaMemsetAsync(dst, 0, bytes, ToCuda(stream)), "cudaMemsetAsync");
  }

  void Copy(void* dst, const void* src, size_t bytes, StreamHandle stream) override {
    DeviceGuard guard(spec_.index);
    Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, ToCuda(stream)), "cudaMemcpyAsync");
  }

  void Synchronize(StreamHandle stream) override {
    DeviceGuard guard(spec_.index);
    Check(cudaStreamSynchronize(ToCuda(stream)), "cudaStreamSynchronize");
  }

  void Order(StreamHandle from, StreamHandle to) override {
    if (from == to) return;
    DeviceGuard guard(spec_.index);
    // `from` may be a stream another thread is capturing (the last stream of
    // a session that a batch shared with others): an event recorded on it
    // now would join that capture. Wait for captures to end.
    std::shared_lock<std::shared_mutex> no_capture(capture_gate_);
    cudaEvent_t event = nullptr;
    Check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    cudaError_t err = cudaEventRecord(event, ToCuda(from));
    if (err == cudaSuccess) err = cudaStreamWaitEvent(ToCuda(to), event, 0);
    cudaEventDestroy(event);  // released once the wait has been satisfied
    Check(err, "ordering streams");
  }

  bool supports_graphs() const override { return true; }

  StreamHandle CaptureStream(StreamHandle stream) override {
    if (stream != nullptr && ToCuda(stream) != cudaStreamLegacy) return stream;
    std::call_once(capture_stream_once_, [this] {
      DeviceGuard guard(spec_.index);
      Check(cudaStreamCreateWithFlags(&capture_stream_, cudaStreamNonBlocking),
            "creating the capture stream");
    });
    if (capture_stream_ == nullptr) Throw(ErrorKind::kRun, "no capture stream");
    return capture_stream_;
  }

  void BeginCapture(StreamHandle stream) override {
    DeviceGuard guard(spec_.index);
    // A capture holds the gate: no other thread records an event on the
    // capturing stream (Order) until it ends.
    capture_gate_.lock();
    t_holds_gate = true;
    // Thread-local: only this thread's unsafe calls break the capture; other
    // threads keep running their sessions.
    cudaError_t err = cudaStreamBeginCapture(ToCuda(stream), cudaStreamCaptureModeThreadLocal);
    if (err != cudaSuccess) OpenGate();
    Check(err, "cudaStreamBeginCapture");
  }

  void* EndCapture(StreamHandle stream) override {
    DeviceGuard guard(spec_.index);
    cudaGraph_t graph = nullptr;
    cudaError_t err = cudaStreamEndCapture(ToCuda(stream), &graph);
    OpenGate();
    if (err != cudaSuccess || graph == nullptr) {
      if (graph != nullptr) cudaGraphDestroy(graph);
      Check(err != cudaSuccess ? err : cudaErrorStreamCaptureInvalidated, "capturing a CUDA graph");
    }
    cudaGraphExec_t exec = nullptr;
    err = cudaGraphInstantiateWithFlags(&exec, graph, 0);
    cudaGraphDestroy(graph);  // the executable graph keeps what it needs
    Check(err, "cudaGraphInstantiate");
    return exec;
  }

  void AbortCapture(StreamHandle stream) noexcept override {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(ToCuda(stream), &status) == cudaSuccess &&
        status != cudaStreamCaptureStatusNone) {
      cudaGraph_t graph = nullptr;
      cudaStreamEndCapture(ToCuda(stream), &graph);
      if (graph != nullptr) cudaGraphDestroy(graph);
    }
    OpenGate();
    cudaGetLastError();  // a failed capture leaves a non-sticky error behind
  }

  void Launch(void* graph, StreamHandle stream) override {
    Check(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), ToCuda(stream)), "cudaGraphLaunch");
  }

  void DestroyGraph(void* graph) noexcept override {
    if (graph != nullptr && cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph)) != cudaSuccess) {
      cudaGetLastError();
    }
  }

 private:
  cudaMemPool_t pool_ = nullptr;
  // Ends this thread's hold of the capture gate, if it has one.
  void OpenGate() noexcept {
    if (!t_holds_gate) return;
    t_holds_gate = false;
    capture_gate_.unlock();
  }

  // Held exclusively across a capture, shared by Order (a leaf: nothing is
  // taken under it; see engine.h).
  std::shared_mutex capture_gate_;
  static inline thread_local bool t_holds_gate = false;
  std::once_flag capture_stream_once_;
  cudaStream_t capture_stream_ = nullptr;  // for work of the legacy default stream
};

}  // namespace

std::unique_ptr<Device> OpenCudaDevice(const DeviceSpec& spec) {
  return std::make_unique<CudaDevice>(spec);
}

}  // namespace aoti_sessions
