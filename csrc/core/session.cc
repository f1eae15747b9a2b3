// Session operations: runs, reset, fork, state copies and close, each under the
// session's own lock so that a close waits for this session's run in flight.
#include "session.h"

#include "engine.h"
#include "errors.h"

namespace aoti_sessions {

Session::Session(std::shared_ptr<Engine> engine, uint64_t id, void* block, StreamHandle stream)
    : engine_(std::move(engine)), id_(id), block_(block), stream_(stream) {
  const Device& device = *engine_->device_;
  auto* base = static_cast<char*>(block_);
  for (const MutableBuffer& buffer : engine_->buffers_) {
    tensors_.push_back(OwnedTensor::FromBlob(base + buffer.offset, buffer.layout,
                                             device.torch_device_type(), device.spec().index));
  }
}

Session::~Session() {
  try {
    Close();
  } catch (...) {
    // A destructor must not throw; Close only fails on a broken device runtime.
  }
}

bool Session::closed() const { return closed_.load(); }

void Session::Use(StreamHandle stream) { stream_.Use(*engine_->device_, stream); }

const void* Session::address() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return closed_ ? nullptr : block_;
}

void Session::CheckOpen() const {
  if (closed_) Throw(ErrorKind::kSessionClosed, "session " + std::to_string(id_) + " is closed");
}

std::vector<OwnedTensor> Session::Run(size_t method, std::vector<OwnedTensor>&& inputs,
                                      StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  CheckOpen();
  Use(stream);
  return engine_->RunLocked(*this, method, std::move(inputs), stream);
}

void Session::Reset(StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  CheckOpen();
  Use(stream);
  engine_->InitializeBlock(block_, stream);
}

std::shared_ptr<Session> Session::Fork(StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  CheckOpen();
  Use(stream);
  return engine_->CreateSession(stream, block_);
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
  std::lock_guard<std::mutex> lock(mutex_);
  CheckOpen();
  CheckBufferTensor(buffer, dst, "destination");
  Use(stream);
  const MutableBuffer& b = engine_->buffers_[buffer];
  engine_->device_->Copy(DataPtr(dst), static_cast<char*>(block_) + b.offset, b.bytes, stream);
}

void Session::WriteBuffers(const std::vector<AtenTensorHandle>& sources, StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  CheckOpen();
  const auto& buffers = engine_->buffers_;
  if (sources.size() != buffers.size()) {
    Throw(ErrorKind::kInvalidArgument, "state needs " + std::to_string(buffers.size()) +
                                           " buffers, got " + std::to_string(sources.size()));
  }
  for (size_t i = 0; i < sources.size(); ++i) CheckBufferTensor(i, sources[i], "source");
  Use(stream);
  for (size_t i = 0; i < sources.size(); ++i) {
    engine_->device_->Copy(static_cast<char*>(block_) + buffers[i].offset, DataPtr(sources[i]),
                           buffers[i].bytes, stream);
  }
}

void Session::Close() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return;
  closed_ = true;
  engine_->ReleaseSession(*this);
}

}  // namespace aoti_sessions
