// Session operations on pooled state (docs/batching.md): runs over many
// sessions at once, and what reset, fork, truncate, state copies and saves do
// to a session's share of the pool. Each runs under the session's lock (a
// batch: every row's, taken in id order).
#include <algorithm>
#include <numeric>

#include "errors.h"
#include "session.h"
#include "util.h"

namespace aoti_sessions {

// The locks of a batch's sessions, taken in id order (so two batches never
// wait on each other crosswise), after the process check. Releasing them
// tells the residency sessions may have become idle.
class Session::BatchLock {
 public:
  BatchLock(const EngineParts& parts, std::vector<SessionState*> states)
      : parts_(parts), states_(std::move(states)) {
    parts_.CheckProcess();
    std::sort(states_.begin(), states_.end(),
              [](const SessionState* a, const SessionState* b) { return a->id() < b->id(); });
    for (size_t i = 1; i < states_.size(); ++i) {
      if (states_[i] == states_[i - 1]) {
        Throw(ErrorKind::kInvalidArgument, "session " + std::to_string(states_[i]->id()) +
                                               " is given twice in one batch");
      }
    }
    for (SessionState* state : states_) state->mutex().lock();
  }
  ~BatchLock() NO_THREAD_SAFETY_ANALYSIS {
    for (SessionState* state : states_) state->mutex().unlock();
    parts_.residency->NotifyIdle();
  }
  BatchLock(const BatchLock&) = delete;
  BatchLock& operator=(const BatchLock&) = delete;

 private:
  const EngineParts& parts_;
  std::vector<SessionState*> states_;
};

namespace {

// The sessions of a batch as the residency's "held" list.
std::vector<const SessionState*> Held(const std::vector<SessionState*>& rows) {
  return {rows.begin(), rows.end()};
}

}  // namespace

std::vector<OwnedTensor> Session::RunBatch(const std::vector<std::shared_ptr<Session>>& rows,
                                           size_t method, std::vector<OwnedTensor>&& inputs,
                                           StreamHandle stream) {
  if (rows.empty()) Throw(ErrorKind::kInvalidArgument, "a batch needs at least one session");
  const std::shared_ptr<const EngineParts>& parts = rows[0]->parts_;
  std::vector<SessionState*> states;
  for (const auto& row : rows) {
    if (row == nullptr) Throw(ErrorKind::kInvalidArgument, "a batch row is not a session");
    if (row->parts_ != parts) {
      Throw(ErrorKind::kInvalidArgument, "session " + std::to_string(row->id()) +
                                             " belongs to another engine than the batch's first");
    }
    states.push_back(row->state_.get());
  }
  BatchLock lock(*parts, states);
  return RunRowsLocked(*parts, states, method, std::move(inputs), stream);
}

std::vector<OwnedTensor> Session::RunRowsLocked(const EngineParts& parts,
                                                const std::vector<SessionState*>& rows,
                                                size_t method, std::vector<OwnedTensor>&& inputs,
                                                StreamHandle stream) NO_THREAD_SAFETY_ANALYSIS {
  // Every row's lock is held (a dynamic set, which the analysis cannot follow).
  // The time the rows take here, for stats (the caller's host work a step).
  struct Timed {
    Runner& runner;
    int64_t start = SteadyNowNs();
    ~Timed() { runner.NoteBatchTime(SteadyNowNs() - start); }
  } timed{*parts.runner};
  const Method& called = parts.model->method(method);
  if (!called.pool) {
    Throw(ErrorKind::kInvalidArgument, "method '" + called.name + "' takes no pooled state");
  }
  PoolStore& store = parts.store->Pooled("a pooled method needs pooled state");  // (it has it)
  const PoolLayout& layout = store.layout();
  // New positions per row: the tokens input's second dimension.
  const auto tokens = static_cast<size_t>(
      std::find(called.caller_inputs.begin(), called.caller_inputs.end(), called.pool->tokens) -
      called.caller_inputs.begin());
  if (tokens >= inputs.size()) {
    Throw(ErrorKind::kInvalidArgument, "method '" + called.name + "' takes " +
                                           std::to_string(called.caller_inputs.size()) +
                                           " tensor inputs besides the pooled state, got " +
                                           std::to_string(inputs.size()));
  }
  const TensorLayout fed = ReadLayout(inputs[tokens].get(), "the tokens input");
  if (fed.sizes.size() < 2 || fed.sizes[1] < 1) {
    Throw(ErrorKind::kInvalidArgument, "input " + std::to_string(called.pool->tokens) +
                                           " of method '" + called.name + "' is " +
                                           FormatDims(fed.sizes) +
                                           "; it takes [rows, positions, ...] with positions >= 1");
  }
  const int64_t count = fed.sizes[1];
  Device& device = parts.model->device();
  const std::vector<const SessionState*> held = Held(rows);
  for (SessionState* state : rows) {
    state->CheckOpen();
    parts.residency->Restore(*state, stream, held);
    state->Touch();
    state->Use(device, stream);
    const int64_t length = state->share().length;
    if (length + count > layout.max_positions()) {
      Throw(ErrorKind::kInvalidArgument,
            "session " + std::to_string(state->id()) + " holds " + std::to_string(length) +
                " positions; " + std::to_string(count) + " more would pass the " +
                std::to_string(layout.max_positions()) + " a session holds (" +
                std::to_string(layout.max_pages) + " pages of " +
                std::to_string(layout.page_size) + ")");
    }
  }
  // Room for the rows' new pages, then the pages (copies of shared ones).
  {
    int64_t growth = 0;
    for (const SessionState* state : rows) growth += store.Growth(*state, count);
    PoolLease lease(store, *parts.residency, held, growth, stream);
    try {
      for (SessionState* state : rows) lease.Grow(*state, count, stream);
    } catch (...) {
      // A row's pages could not be had (the device out of memory, say): the
      // rows grown before it give theirs back, as a failed run's do below (a
      // session holds the pages of its positions, no more: saving, reading and
      // offloading it size their copies by its length).
      for (SessionState* state : rows) lease.Trim(*state, stream);
      throw;
    }
  }
  std::vector<const PoolShare*> shares;
  for (const SessionState* state : rows) shares.push_back(&state->share());
  std::vector<OwnedTensor> outputs;
  try {
    outputs = parts.runner->RunPooled(method, store.pool(), shares, std::move(inputs), stream);
  } catch (...) {
    // Nothing was fed: the pages taken for it go back.
    PoolLease lease(store, *parts.residency);
    for (SessionState* state : rows) lease.Trim(*state, stream);
    throw;
  }
  for (SessionState* state : rows) state->share().length += count;
  return outputs;
}

int64_t Session::length() {
  OpLock lock(*this);
  return state_->share().length;
}

std::vector<OwnedTensor> Session::ReadPool(int64_t* length, StreamHandle stream) {
  OpLock lock(*this);
  state_->CheckOpen();
  PoolStore& store = parts_->store->Pooled("this engine has no pooled state; use ReadBuffers");
  const PoolLayout& layout = store.layout();
  const PoolShare& share = state_->share();
  Device& device = parts_->model->device();
  state_->Use(device, stream);
  *length = share.length;
  const size_t pages = layout.PagesFor(share.length);
  std::vector<OwnedTensor> out;
  std::vector<void*> parts;
  TorchStreamScope scope(stream, device.spec().index);
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    out.push_back(OwnedTensor::Empty(layout.SessionLayout(i, pages), device.torch_device_type(),
                                     device.spec().index));
    parts.push_back(DataPtr(out.back().get()));
  }
  if (state_->resident()) {
    store.pool().PackTensors(share, parts, stream);
  } else {
    const std::vector<size_t> offsets = layout.PackedOffsets(pages);
    for (size_t i = 0; i < layout.tensors.size(); ++i) {
      const size_t bytes = ReadLayout(out[i].get()).span_bytes();
      device.Copy(parts[i], state_->memory() + offsets[i], bytes, stream);
    }
    device.Synchronize(stream);  // the host copy may move once unlocked
  }
  return out;
}

void Session::WritePool(const std::vector<std::string>& names,
                        const std::vector<AtenTensorHandle>& sources, int64_t length,
                        StreamHandle stream) {
  OpLock lock(*this);
  state_->CheckOpen();
  PoolStore& store = parts_->store->Pooled("this engine has no pooled state; use WriteBuffers");
  const PoolLayout& layout = store.layout();
  if (names.size() != sources.size()) {
    Throw(ErrorKind::kInvalidArgument, "state: " + std::to_string(names.size()) +
                                           " names for " + std::to_string(sources.size()) +
                                           " tensors");
  }
  if (length < 0 || length > layout.max_positions()) {
    Throw(ErrorKind::kInvalidArgument, "state length " + std::to_string(length) +
                                           " is outside [0, " +
                                           std::to_string(layout.max_positions()) + "]");
  }
  const size_t pages = layout.PagesFor(length);
  Device& device = parts_->model->device();
  std::vector<const void*> parts(layout.tensors.size(), nullptr);
  std::vector<std::string> unexpected, missing;
  for (size_t i = 0; i < names.size(); ++i) {
    auto it = std::find_if(layout.tensors.begin(), layout.tensors.end(),
                           [&](const PooledTensor& t) { return t.name == names[i]; });
    const size_t index = static_cast<size_t>(it - layout.tensors.begin());
    if (it == layout.tensors.end() || parts[index] != nullptr) {
      unexpected.push_back(names[i]);
      continue;
    }
    const PooledTensor& t = *it;
    const std::string which = "state for pooled tensor '" + t.name + "'";
    TensorLayout got = ReadLayout(sources[i], which);
    const TensorLayout want = layout.SessionLayout(index, pages);
    if (got.dtype != want.dtype) {
      Throw(ErrorKind::kTypeMismatch, which + " has dtype " + DtypeName(got.dtype) +
                                          ", expected " + DtypeName(want.dtype));
    }
    if (got.sizes != want.sizes || (got.numel() > 0 && got.strides != want.strides)) {
      Throw(ErrorKind::kInvalidArgument, which + " is " + got.ToString() + "; a session of " +
                                             std::to_string(length) + " positions takes " +
                                             want.ToString());
    }
    const int32_t type = DeviceType(sources[i]);
    const bool on_engine = type == device.torch_device_type() &&
                           (device.spec().kind == DeviceKind::kCpu ||
                            DeviceIndex(sources[i]) == device.spec().index);
    if (!on_engine && type != Shim().device_type_cpu) {
      Throw(ErrorKind::kInvalidArgument, which + " is on " +
                                             DeviceName(type, DeviceIndex(sources[i])) +
                                             "; it must be on the engine's device " +
                                             device.spec().ToString() + " or the host");
    }
    parts[index] = DataPtr(sources[i]);
  }
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    if (parts[i] == nullptr) missing.push_back(layout.tensors[i].name);
  }
  if (!missing.empty() || !unexpected.empty()) {
    Throw(ErrorKind::kInvalidArgument, "state does not match the engine's pooled tensors: missing " +
                                           JoinNames(missing) + ", unexpected " +
                                           JoinNames(unexpected));
  }
  // Every check passed: the session's units are replaced by new ones.
  Prepare(stream);
  {
    PoolLease(store, *parts_->residency)
        .DropCheckpoints(*state_, 0, state_->share().checkpoints.size(), stream);
    const int64_t extra = store.pool().SessionBytes(pages) - state_->bytes();
    PoolLease lease(store, *parts_->residency, {state_.get()}, extra, stream);
    lease.Replace(*state_, pages, length, stream);
  }
  store.pool().UnpackTensors(parts, state_->share(), stream);
  device.Synchronize(stream);  // the sources may be freed once this returns
}

}  // namespace aoti_sessions
