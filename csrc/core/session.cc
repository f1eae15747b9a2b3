// Session operations: runs, reset, fork, state copies, offload / restore, save
// and close, each under the session's own lock.
#include "session.h"

#include <numeric>

#include "errors.h"
#include "util.h"

namespace aoti_sessions {

bool EngineParts::in_forked_child() const {
  return ProcessGeneration() != process_generation;
}

void EngineParts::CheckProcess() const {
  if (in_forked_child()) {
    Throw(ErrorKind::kOtherProcess,
          "this engine was created before os.fork(); it cannot be used in the child process "
          "(the parent's threads and locks did not come along): create a new Engine in the "
          "child");
  }
}

std::shared_ptr<Session> Session::Make(std::shared_ptr<const EngineParts> parts,
                                       std::shared_ptr<SessionState> state) {
  try {
    return std::make_shared<Session>(parts, state);
  } catch (...) {
    MutexLock lock(state->mutex());
    parts->residency->Release(*state, "");
    throw;
  }
}

Session::Session(std::shared_ptr<const EngineParts> parts, std::shared_ptr<SessionState> state)
    : parts_(std::move(parts)), state_(std::move(state)) {}

Session::~Session() {
  if (parts_->in_forked_child()) {
    // Nothing of the parent's engine may be touched here (a lock may be held
    // forever, a device context may be gone): leave it all, as the OS will.
    new std::shared_ptr<const EngineParts>(std::move(parts_));
    new std::shared_ptr<SessionState>(std::move(state_));
    return;
  }
  try {
    Close();
  } catch (...) {
    // A destructor must not throw; Close only fails on a broken device runtime.
  }
}

const void* Session::address() const {
  OpLock lock(*this);
  return state_->closed() || !state_->resident() ? nullptr : state_->device_block();
}

void Session::SetDiscardable(bool discardable) {
  OpLock lock(*this);
  state_->CheckOpen();
  state_->set_discardable(discardable);
}

namespace {

// What the residency runs to fill a new session made from `source`.
Residency::Fill FillFrom(StateStore& store, const StateStore::Source& source) {
  return [&store, &source](SessionState& made, StreamHandle stream) {
    made.mutex().AssertHeld();  // Admit holds it
    store.Fill(made, source, stream);
  };
}

}  // namespace

std::shared_ptr<Session> Session::New(std::shared_ptr<const EngineParts> parts,
                                     SessionFiles::CheckedFile* file, StreamHandle stream) {
  StateStore& store = *parts->store;
  HostCopy staged;  // a file's state: every byte checked before a session is made
  StateStore::Source source;
  if (file != nullptr) {
    staged = store.ReadFile(*parts->files, *file);
    source = StateStore::From(staged);
  }
  auto state = parts->residency->Admit(store.BytesOf(source), stream, FillFrom(store, source));
  return Make(std::move(parts), std::move(state));
}

void Session::Prepare(StreamHandle stream) {
  parts_->residency->Restore(*state_, stream);
  state_->Touch();
  state_->Use(parts_->model->device(), stream);
}

std::vector<OwnedTensor> Session::Run(size_t method, std::vector<OwnedTensor>&& inputs,
                                      StreamHandle stream) {
  OpLock lock(*this);
  if (parts_->model->method(method).pool) {
    return RunRowsLocked(*parts_, {state_.get()}, method, std::move(inputs), stream);
  }
  state_->CheckOpen();
  Prepare(stream);
  return parts_->runner->Run(*state_, method, std::move(inputs), stream);
}

void Session::Reset(StreamHandle stream) {
  OpLock lock(*this);
  state_->CheckOpen();
  Prepare(stream);
  parts_->store->Reset(*state_, *parts_->residency, stream);
}

std::shared_ptr<Session> Session::Fork(StreamHandle stream) {
  OpLock lock(*this);
  state_->CheckOpen();
  StateStore& store = *parts_->store;
  state_->Use(parts_->model->device(), stream);
  const StateStore::Source source = store.From(*state_);
  auto child = parts_->residency->AdmitBeside(*state_, store.BytesOf(source), stream,
                                              FillFrom(store, source));
  return Make(parts_, std::move(child));
}

void Session::CheckBufferTensor(size_t buffer, AtenTensorHandle tensor, const char* role) const {
  const auto& buffers = parts_->model->buffers();
  if (buffer >= buffers.size()) {
    Throw(ErrorKind::kInvalidArgument, "buffer index " + std::to_string(buffer) +
                                           " out of range (" + std::to_string(buffers.size()) +
                                           " mutable buffers)");
  }
  const MutableBuffer& want = buffers[buffer];
  std::string which = std::string(role) + " for '" + want.fqn + "'";
  TensorLayout got = ReadLayout(tensor, which);
  if (got.dtype != want.layout.dtype) {
    Throw(ErrorKind::kTypeMismatch, which + " has dtype " + DtypeName(got.dtype) +
                                        ", expected " + DtypeName(want.layout.dtype));
  }
  if (got.sizes != want.layout.sizes) {
    Throw(ErrorKind::kInvalidArgument, which + " has shape " + FormatDims(got.sizes) +
                                           ", expected " + FormatDims(want.layout.sizes));
  }
  if (got.strides != want.layout.strides) {
    Throw(ErrorKind::kInvalidArgument, which + " has strides " + FormatDims(got.strides) +
                                           ", expected " + FormatDims(want.layout.strides));
  }
  const Device& device = parts_->model->device();
  int32_t type = DeviceType(tensor);
  bool on_engine = type == device.torch_device_type() &&
                   (device.spec().kind == DeviceKind::kCpu ||
                    DeviceIndex(tensor) == device.spec().index);
  if (!on_engine && type != Shim().device_type_cpu) {
    Throw(ErrorKind::kInvalidArgument, which + " is on " + DeviceName(type, DeviceIndex(tensor)) +
                                           "; it must be on the engine's device " +
                                           device.spec().ToString() + " or the host");
  }
}

void Session::CopyOut(const std::vector<size_t>& indices, const std::vector<AtenTensorHandle>& dsts,
                      StreamHandle stream) {
  OpLock lock(*this);
  state_->CheckOpen();
  for (size_t i = 0; i < indices.size(); ++i) CheckBufferTensor(indices[i], dsts[i], "destination");
  Device& device = parts_->model->device();
  state_->Use(device, stream);
  for (size_t i = 0; i < indices.size(); ++i) {
    const MutableBuffer& b = parts_->model->buffers()[indices[i]];
    device.Copy(DataPtr(dsts[i]), state_->memory() + b.offset, b.bytes, stream);
  }
  // An offloaded block may be restored (and its memory reused) once unlocked.
  if (!state_->resident()) device.Synchronize(stream);
}

void Session::ReadBuffer(size_t buffer, AtenTensorHandle dst, StreamHandle stream) {
  CopyOut({buffer}, {dst}, stream);
}

void Session::ReadBuffers(const std::vector<AtenTensorHandle>& dsts, StreamHandle stream) {
  const size_t n = parts_->model->buffers().size();
  if (dsts.size() != n) {
    Throw(ErrorKind::kInvalidArgument, "state has " + std::to_string(n) + " buffers, got " +
                                           std::to_string(dsts.size()) + " destinations");
  }
  std::vector<size_t> all(n);
  std::iota(all.begin(), all.end(), 0);
  CopyOut(all, dsts, stream);
}

namespace {

// "['a', 'b']" (bounded, like every list of names in messages).
std::string QuotedList(const std::vector<std::string>& names) {
  std::vector<std::string> quoted;
  for (const auto& n : names) quoted.push_back("'" + n + "'");
  return "[" + (names.empty() ? std::string() : JoinNames(quoted)) + "]";
}

}  // namespace

void Session::WriteBuffers(const std::vector<std::string>& fqns,
                           const std::vector<AtenTensorHandle>& sources, StreamHandle stream) {
  OpLock lock(*this);
  state_->CheckOpen();
  const Model& model = *parts_->model;
  const auto& buffers = model.buffers();
  if (fqns.size() != sources.size()) {
    Throw(ErrorKind::kInvalidArgument, "state: " + std::to_string(fqns.size()) + " names for " +
                                           std::to_string(sources.size()) + " tensors");
  }
  // The source of each buffer, in engine order.
  std::vector<AtenTensorHandle> ordered(buffers.size(), nullptr);
  std::vector<std::string> missing, unexpected;
  for (size_t i = 0; i < fqns.size(); ++i) {
    if (!model.is_mutable(fqns[i]) || ordered[model.buffer_index(fqns[i])] != nullptr) {
      unexpected.push_back(fqns[i]);
    } else {
      ordered[model.buffer_index(fqns[i])] = sources[i];
    }
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (ordered[i] == nullptr) missing.push_back(buffers[i].fqn);
  }
  if (!missing.empty() || !unexpected.empty()) {
    Throw(ErrorKind::kInvalidArgument, "state does not match the engine's buffers: missing " +
                                           QuotedList(missing) + ", unexpected " +
                                           QuotedList(unexpected));
  }
  for (size_t i = 0; i < ordered.size(); ++i) CheckBufferTensor(i, ordered[i], "state");
  Device& device = model.device();
  state_->Touch();
  state_->Use(device, stream);
  for (size_t i = 0; i < ordered.size(); ++i) {
    device.Copy(state_->memory() + buffers[i].offset, DataPtr(ordered[i]), buffers[i].bytes, stream);
  }
  if (!state_->resident()) device.Synchronize(stream);
}

void Session::Offload(StreamHandle stream) {
  OpLock lock(*this);
  state_->CheckOpen();
  parts_->residency->Offload(*state_, stream, OffloadCause::kRequest);
}

void Session::Restore(StreamHandle stream) {
  OpLock lock(*this);
  state_->CheckOpen();
  parts_->residency->Restore(*state_, stream);
  state_->Touch();
}

void Session::Save(const std::string& path, const std::string& attachment, StreamHandle stream) {
  Snapshot(stream)->Write(path, attachment);
}

std::shared_ptr<SessionSnapshot> Session::Snapshot(StreamHandle stream) {
  parts_->CheckProcess();
  std::shared_ptr<SessionSnapshot> snapshot(new SessionSnapshot(parts_));
  snapshot->copy_ = parts_->store->NewHostCopy();  // (host memory taken before the lock)
  OpLock lock(*this);
  state_->CheckOpen();
  parts_->store->CopyOut(*state_, snapshot->copy_, stream);
  return snapshot;
}

void SessionSnapshot::Write(const std::string& path, const std::string& attachment) const {
  parts_->CheckProcess();
  parts_->store->WriteFile(*parts_->files, path, copy_, attachment);
}

size_t SessionSnapshot::bytes() const { return copy_.bytes; }

void Session::Close() {
  OpLock lock(*this);
  parts_->residency->Release(*state_, "");
}

}  // namespace aoti_sessions
