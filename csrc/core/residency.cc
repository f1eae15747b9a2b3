// The registry of sessions and the two tiers of their state: admission under
// max_sessions, offload / restore, release, the idle reaper, and the counts
// stats() reports. Making room under memory_budget is in eviction.cc.
#include "residency.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "errors.h"
#include "util.h"

namespace aoti_sessions {

std::shared_ptr<Residency> Residency::Create(std::shared_ptr<Model> model,
                                             std::shared_ptr<StateStore> store,
                                             const EngineOptions& options,
                                             LeftDevice left_device) {
  std::shared_ptr<Residency> residency(new Residency(std::move(model), std::move(store), options));
  residency->left_device_ = std::move(left_device);
  if (residency->idle_timeout_seconds_) {
    // Check often enough to expire within an eighth of the timeout.
    auto period = std::chrono::duration<double>(*residency->idle_timeout_seconds_ / 8);
    period = std::clamp(period, std::chrono::duration<double>(0.005),
                        std::chrono::duration<double>(1.0));
    // The thread holds the residency only while it checks; if that makes it
    // the last owner, the residency ends on the thread, which then detaches.
    residency->reaper_ = std::make_unique<PeriodicThread>(
        period, [weak = std::weak_ptr<Residency>(residency)] {
          std::shared_ptr<Residency> self = weak.lock();
          if (!self) return false;
          self->ExpireIdle();
          return true;
        });
  }
  return residency;
}

Residency::Residency(std::shared_ptr<Model> model, std::shared_ptr<StateStore> store,
                     const EngineOptions& options)
    : model_(std::move(model)),
      store_(std::move(store)),
      device_(model_->device()),
      block_bytes_(static_cast<int64_t>(model_->block_bytes())),
      max_sessions_(options.max_sessions),
      memory_budget_(options.memory_budget),
      host_budget_(options.host_budget),
      idle_timeout_seconds_(options.idle_timeout_seconds),
      idle_action_(options.idle_action) {}

Residency::~Residency() { reaper_.reset(); }

// ---------------------------------------------------------------- admission

std::shared_ptr<SessionState> Residency::Admit(int64_t bytes, StreamHandle stream,
                                               const Fill& fill) {
  return AdmitFor({}, bytes, stream, fill);
}

std::shared_ptr<SessionState> Residency::AdmitBeside(SessionState& held, int64_t bytes,
                                                     StreamHandle stream, const Fill& fill) {
  // While this call waits for room, `held` stays busy: evictors skip it and
  // waiters know it will not become idle before this call proceeds.
  struct Waiting {
    SessionState& state;
    const bool marked;
    explicit Waiting(SessionState& s) : state(s), marked(s.resident()) {
      if (marked) state.set_waiting_for_room(true);
    }
    ~Waiting() {
      if (marked) state.set_waiting_for_room(false);
    }
  } waiting(held);
  return AdmitFor({&held}, bytes, stream, fill);
}

std::shared_ptr<SessionState> Residency::AdmitFor(const Held& held, int64_t bytes,
                                                  StreamHandle stream, const Fill& fill) {
  uint64_t id = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (MutexLock lock(registry_mutex_);;) {
    if (closed_) Throw(ErrorKind::kSessionClosed, "the engine is closed");
    if (!max_sessions_ || live_sessions_ < *max_sessions_) {
      ++live_sessions_;
      id = next_session_id_++;
      break;
    }
    const std::string full = "max_sessions=" + std::to_string(*max_sessions_) + " reached: " +
                             std::to_string(live_sessions_) + " sessions are open";
    std::vector<std::shared_ptr<SessionState>> open = OpenStatesRegistryLocked();
    lock.Unlock();
    // A discardable session makes way (its count goes once it is closed).
    const Discard discarded = DiscardLeastRecentlyUsed(std::move(open), held, /*resident_only=*/false);
    lock.Lock();
    if (discarded == Discard::kNone || std::chrono::steady_clock::now() >= deadline) {
      Throw(ErrorKind::kCapacity, full);
    }
    if (discarded == Discard::kBusy) WaitForIdle(lock);  // (one being forked: it goes once idle)
  }
  try {
    ReserveDevice(held, bytes, stream, /*host_credit=*/0);
  } catch (...) {
    MutexLock lock(registry_mutex_);
    --live_sessions_;
    throw;
  }
  void* block = nullptr;
  std::shared_ptr<SessionState> state;
  try {
    if (block_bytes_ > 0) block = device_.Allocate(static_cast<size_t>(block_bytes_), stream);
    state = std::make_shared<SessionState>(id, block, model_->AliasTensors(block), stream, bytes);
  } catch (...) {
    if (block != nullptr) {
      try {
        device_.Free(block, stream);
      } catch (...) {
      }
    }
    Forget(id, /*resident=*/true, bytes);
    throw;
  }
  {
    MutexLock lock(state->mutex());
    try {
      fill(*state, stream);
    } catch (...) {
      // Nothing was handed to a session: release what the fill took too.
      Release(*state, "");
      throw;
    }
  }
  {
    MutexLock lock(registry_mutex_);
    if (!closed_) {
      states_[id] = state;
      ++sessions_created_;
      return state;
    }
  }
  // The engine closed while this session was being made: it must not outlive it.
  {
    MutexLock lock(state->mutex());
    Release(*state, "");
  }
  Throw(ErrorKind::kSessionClosed, "the engine is closed");
}

void Residency::Reserve(const Held& held, int64_t extra, StreamHandle stream) {
  if (extra > 0) ReserveDevice(held, extra, stream, /*host_credit=*/0);
}

void Residency::Shrink(int64_t bytes) {
  if (bytes <= 0) return;
  MutexLock lock(registry_mutex_);
  device_bytes_ -= bytes;
  RetainRegistryLocked();
}

// ---------------------------------------------------------------- tiers

void Residency::Offload(SessionState& state, StreamHandle stream, OffloadCause cause) {
  OffloadWithCredit(state, stream, cause, 0);
}

void Residency::OffloadWithCredit(SessionState& state, StreamHandle stream, OffloadCause cause,
                                  int64_t host_credit) {
  if (!state.resident()) return;
  store_->DropDeviceOnly(state, *this, stream);
  const int64_t need = state.bytes();
  {
    MutexLock lock(registry_mutex_);
    if (host_budget_ && host_bytes_ + need - host_credit > *host_budget_) {
      Throw(ErrorKind::kCapacity,
            "host_budget=" + BytesText(*host_budget_) + " is full: " +
                std::to_string(offloaded_sessions_) + " offloaded sessions hold " +
                BytesText(host_bytes_) + " and session " + std::to_string(state.id()) +
                " needs " + std::to_string(need));
    }
    host_bytes_ += need;
  }
  void* host = nullptr;
  try {
    state.Use(device_, stream);
    host = store_->ToHost(state, stream);
  } catch (...) {
    MutexLock lock(registry_mutex_);
    host_bytes_ -= need;
    throw;
  }
  if (left_device_) left_device_(state);
  void* device_block = state.MoveToHost(host);
  try {
    if (device_block != nullptr) device_.Free(device_block, stream);
  } catch (...) {
    // The state is safe on the host; a failed free only leaks device memory.
  }
  {
    MutexLock lock(registry_mutex_);
    device_bytes_ -= need;
    ++offloaded_sessions_;
    RetainRegistryLocked();
  }
  offloads_.fetch_add(1);
  if (cause == OffloadCause::kEviction) evictions_.fetch_add(1);
  if (cause == OffloadCause::kIdle) idle_offloads_.fetch_add(1);
}

void Residency::Restore(SessionState& state, StreamHandle stream, const Held& also_held) {
  if (state.resident()) return;
  const int64_t bytes = state.bytes();
  Held held = also_held;
  held.push_back(&state);
  // The restore releases its own host block right after evicting: the swap
  // leaves host use unchanged, so a full host budget does not stop it.
  ReserveDevice(held, bytes, stream, /*host_credit=*/bytes);
  void* block = nullptr;
  std::vector<OwnedTensor> tensors;
  try {
    state.Use(device_, stream);
    block = store_->ToDevice(state, stream);
    tensors = model_->AliasTensors(block);
  } catch (...) {
    // The session stays offloaded, its host block untouched.
    if (block != nullptr) {
      try {
        device_.Free(block, stream);
      } catch (...) {
      }
    }
    Shrink(bytes);
    throw;
  }
  store_->FreeHost(state.MoveToDevice(block, std::move(tensors)));
  {
    MutexLock lock(registry_mutex_);
    host_bytes_ -= bytes;
    --offloaded_sessions_;
  }
  restores_.fetch_add(1);
}

// ---------------------------------------------------------------- release

void Residency::Release(SessionState& state, const std::string& reason) {
  StreamHandle last = state.last_stream();
  SessionState::Released released = state.Close(reason);
  if (!released.was_open) return;
  if (left_device_) left_device_(state);
  store_->Release(state, released.host_block, last);
  try {
    // Freed in the order of the last stream that used it: after its runs finish.
    if (released.device_block != nullptr) device_.Free(released.device_block, last);
  } catch (...) {
    Forget(state.id(), released.was_resident, state.bytes());
    throw;
  }
  Forget(state.id(), released.was_resident, state.bytes());
}

void Residency::Forget(uint64_t id, bool resident, int64_t bytes) {
  MutexLock lock(registry_mutex_);
  states_.erase(id);
  --live_sessions_;
  if (resident) {
    device_bytes_ -= bytes;
  } else {
    host_bytes_ -= bytes;
    --offloaded_sessions_;
  }
  RetainRegistryLocked();
}

void Residency::RetainRegistryLocked() {
  // The device keeps what weights, live sessions and templates use plus one
  // spare block, so churn (close one, create one) costs a memset or a copy,
  // not a fresh mapping of device memory; anything beyond goes back.
  device_.Retain(model_->weight_bytes() + model_->parking_bytes() +
                 static_cast<size_t>(device_bytes_) + model_->template_bytes() +
                 static_cast<size_t>(block_bytes_) + store_->allocated_bytes());
}

std::vector<std::shared_ptr<SessionState>> Residency::OpenStatesRegistryLocked() const {
  std::vector<std::shared_ptr<SessionState>> open;
  open.reserve(states_.size());
  for (const auto& [id, weak] : states_) {
    if (auto state = weak.lock()) open.push_back(std::move(state));
  }
  return open;
}

// ---------------------------------------------------------------- idle expiry

void Residency::ExpireIdle() {
  // Saturated: a timeout of centuries must not overflow.
  const auto timeout_ns = static_cast<int64_t>(std::min(*idle_timeout_seconds_, 1e9) * 1e9);
  const int64_t limit = SteadyNowNs() - timeout_ns;
  const bool close = idle_action_ == IdleAction::kClose;
  std::vector<std::shared_ptr<SessionState>> open;
  {
    MutexLock lock(registry_mutex_);
    if (closed_) return;
    open = OpenStatesRegistryLocked();
  }
  bool freed = false;
  for (const auto& state : open) {
    if (state->last_use_ns() > limit || !(close || state->resident() || state->discardable())) continue;
    if (!state->mutex().try_lock()) continue;  // in use: not idle
    MutexLock lock(state->mutex(), MutexLock::Adopt{});
    if (state->closed() || state->last_use_ns() > limit) continue;
    try {
      if (state->discardable()) {
        Release(*state, "closed by idle_timeout (a discardable session)");
        discards_.fetch_add(1);
      } else if (close) {
        Release(*state, "closed by idle_timeout=" + std::to_string(*idle_timeout_seconds_) + " s");
        idle_closes_.fetch_add(1);
      } else {
        Offload(*state, state->last_stream(), OffloadCause::kIdle);
      }
      freed = true;
    } catch (...) {
      // Host budget full (or a device error): the session stays where it is.
    }
  }
  if (freed) NotifyIdle();
}

// ---------------------------------------------------------------- engine-wide

void Residency::Close() {
  std::vector<std::shared_ptr<SessionState>> open;
  {
    MutexLock lock(registry_mutex_);
    if (closed_) return;
    closed_ = true;
    open = OpenStatesRegistryLocked();
  }
  if (reaper_) reaper_->Stop();
  // Close everything even if one session fails; report the first failure.
  std::exception_ptr first;
  for (const auto& state : open) {
    try {
      MutexLock lock(state->mutex());  // waits for the session's operation in flight
      Release(*state, "its engine was closed");
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  NotifyIdle();
  if (first) std::rethrow_exception(first);
}

bool Residency::closed() const {
  MutexLock lock(registry_mutex_);
  return closed_;
}

void Residency::AddStats(EngineStats& s) const {
  std::vector<std::shared_ptr<SessionState>> open;
  {
    MutexLock lock(registry_mutex_);
    s.live_sessions = live_sessions_;
    s.device_bytes = device_bytes_;
    s.host_bytes = host_bytes_;
    s.live_bytes = device_bytes_ + host_bytes_;
    s.offloaded_sessions = offloaded_sessions_;
    s.resident_sessions = live_sessions_ - offloaded_sessions_;
    s.sessions_created = sessions_created_;
    open = OpenStatesRegistryLocked();
  }
  for (const auto& state : open) {
    s.sessions.push_back({state->id(), state->resident(), state->bytes(), state->last_use_ns()});
  }
  std::sort(s.sessions.begin(), s.sessions.end(),
            [](const SessionStats& a, const SessionStats& b) { return a.id < b.id; });
  s.host_spare_bytes = static_cast<int64_t>(store_->host_spare_bytes());
  s.offloads = offloads_.load();
  s.evictions = evictions_.load();
  s.idle_offloads = idle_offloads_.load();
  s.idle_closes = idle_closes_.load();
  s.discards = discards_.load();
  s.restores = restores_.load();
}

void Residency::AddMemory(MemoryReport& report) const {
  {
    MutexLock lock(registry_mutex_);
    report.sessions = static_cast<size_t>(device_bytes_);
    report.offloaded = static_cast<size_t>(host_bytes_);
  }
  report.host_spare = store_->host_spare_bytes();
}

}  // namespace aoti_sessions
