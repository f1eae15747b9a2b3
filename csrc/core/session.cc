// Session operations: runs, reset, fork, state copies, offload / restore, save
// and close, each under the session's own lock so that a close (or an
// eviction) waits for this session's run in flight.
#include "session.h"

#include <chrono>

#include "engine.h"
#include "errors.h"

namespace aoti_sessions {

int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The session's lock for one operation. Releasing it tells the engine a
// session may have become idle (evictable), for creators waiting on capacity.
class Session::OpLock {
 public:
  explicit OpLock(Session& s) : session_(s), lock_(s.mutex_) {}
  ~OpLock() {
    lock_.unlock();
    session_.engine_->NotifyIdle();
  }
  OpLock(const OpLock&) = delete;
  OpLock& operator=(const OpLock&) = delete;

 private:
  Session& session_;
  std::unique_lock<std::mutex> lock_;
};

Session::Session(std::shared_ptr<Engine> engine, uint64_t id, void* block, StreamHandle stream,
                 uint64_t bind_key)
    : engine_(std::move(engine)), id_(id), block_(block), bind_key_(bind_key), stream_(stream) {
  tensors_ = AliasTensors(block_);
  Touch();
}

Session::~Session() {
  try {
    Close();
  } catch (...) {
    // A destructor must not throw; Close only fails on a broken device runtime.
  }
}

std::vector<OwnedTensor> Session::AliasTensors(void* block) const {
  const Device& device = *engine_->device_;
  auto* base = static_cast<char*>(block);
  std::vector<OwnedTensor> tensors;
  for (const MutableBuffer& buffer : engine_->buffers_) {
    tensors.push_back(OwnedTensor::FromBlob(base + buffer.offset, buffer.layout,
                                            device.torch_device_type(), device.spec().index));
  }
  return tensors;
}

void Session::Touch() { last_use_ns_.store(SteadyNowNs()); }

bool Session::closed() const { return closed_.load(); }

void Session::Use(StreamHandle stream) { stream_.Use(*engine_->device_, stream); }

const void* Session::address() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return closed_ || !resident_ ? nullptr : block_;
}

void Session::CheckOpen() const {
  if (!closed_) return;
  std::string what = "session " + std::to_string(id_) + " is closed";
  if (!closed_reason_.empty()) what += " (" + closed_reason_ + ")";
  Throw(ErrorKind::kSessionClosed, what);
}

std::vector<OwnedTensor> Session::Run(size_t method, std::vector<OwnedTensor>&& inputs,
                                      StreamHandle stream) {
  OpLock lock(*this);
  CheckOpen();
  if (!resident_) engine_->RestoreLocked(*this, stream);
  Touch();
  Use(stream);
  return engine_->RunLocked(*this, method, std::move(inputs), stream);
}

void Session::Reset(StreamHandle stream) {
  OpLock lock(*this);
  CheckOpen();
  if (!resident_) engine_->RestoreLocked(*this, stream);
  Touch();
  Use(stream);
  engine_->InitializeBlock(block_, stream);
}

std::shared_ptr<Session> Session::Fork(StreamHandle stream) {
  OpLock lock(*this);
  CheckOpen();
  Use(stream);
  return engine_->CreateSession(stream, state(), !resident_, this);
}

void Session::CheckBufferTensor(size_t buffer, AtenTensorHandle tensor, const char* role) const {
  const auto& buffers = engine_->buffers_;
  if (buffer >= buffers.size()) {
    Throw(ErrorKind::kInvalidArgument, "buffer index " + std::to_string(buffer) +
                                           " out of range (" + std::to_string(buffers.size()) +
                                           " mutable buffers)");
  }
  const MutableBuffer& want = buffers[buffer];
  TensorLayout got = ReadLayout(tensor);
  std::string which = std::string(role) + " for '" + want.fqn + "'";
  if (got.dtype != want.layout.dtype) {
    Throw(ErrorKind::kTypeMismatch, which + " has dtype " + DtypeName(got.dtype) +
                                        ", expected " + DtypeName(want.layout.dtype));
  }
  if (got.sizes != want.layout.sizes || got.strides != want.layout.strides) {
    Throw(ErrorKind::kInvalidArgument,
          which + " is " + got.ToString() + ", expected " + want.layout.ToString());
  }
  const Device& device = *engine_->device_;
  int32_t type = DeviceType(tensor);
  bool on_engine = type == device.torch_device_type() &&
                   (device.spec().kind == DeviceKind::kCpu ||
                    DeviceIndex(tensor) == device.spec().index);
  if (!on_engine && type != Shim().device_type_cpu) {
    Throw(ErrorKind::kInvalidArgument,
          which + " must be on the engine's device " + device.spec().ToString() + " or the host");
  }
}

void Session::ReadBuffer(size_t buffer, AtenTensorHandle dst, StreamHandle stream) {
  OpLock lock(*this);
  CheckOpen();
  CheckBufferTensor(buffer, dst, "destination");
  Use(stream);
  const MutableBuffer& b = engine_->buffers_[buffer];
  engine_->device_->Copy(DataPtr(dst), state() + b.offset, b.bytes, stream);
  // An offloaded block may be restored (and its memory reused) once unlocked.
  if (!resident_) engine_->device_->Synchronize(stream);
}

void Session::WriteBuffers(const std::vector<AtenTensorHandle>& sources, StreamHandle stream) {
  OpLock lock(*this);
  CheckOpen();
  const auto& buffers = engine_->buffers_;
  if (sources.size() != buffers.size()) {
    Throw(ErrorKind::kInvalidArgument, "state needs " + std::to_string(buffers.size()) +
                                           " buffers, got " + std::to_string(sources.size()));
  }
  for (size_t i = 0; i < sources.size(); ++i) CheckBufferTensor(i, sources[i], "source");
  Touch();
  Use(stream);
  for (size_t i = 0; i < sources.size(); ++i) {
    engine_->device_->Copy(state() + buffers[i].offset, DataPtr(sources[i]), buffers[i].bytes,
                           stream);
  }
  if (!resident_) engine_->device_->Synchronize(stream);
}

void Session::Offload(StreamHandle stream) {
  OpLock lock(*this);
  CheckOpen();
  engine_->OffloadLocked(*this, stream, Engine::OffloadCause::kRequest);
}

void Session::Restore(StreamHandle stream) {
  OpLock lock(*this);
  CheckOpen();
  if (!resident_) engine_->RestoreLocked(*this, stream);
  Touch();
}

void Session::Save(const std::string& path, StreamHandle stream) {
  Engine& engine = *engine_;
  Engine::HostBlock staging(engine);
  {
    OpLock lock(*this);
    CheckOpen();
    Use(stream);
    if (engine.block_bytes_ > 0) {
      engine.device_->Copy(staging.get(), state(), engine.block_bytes_, stream);
      engine.device_->Synchronize(stream);
    }
  }
  engine.WriteSessionFile(path, staging.get());
}

void Session::Close() {
  OpLock lock(*this);
  CloseLocked("");
}

void Session::CloseLocked(const std::string& reason) {
  if (closed_) return;
  closed_ = true;
  closed_reason_ = reason;
  engine_->ReleaseSession(*this);
}

}  // namespace aoti_sessions
