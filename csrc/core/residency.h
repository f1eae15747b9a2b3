// Where session state lives, and how much of it: the registry of open
// sessions, max_sessions and the device and host budgets, offload / restore
// between the two tiers, eviction of the least recently used idle session, and
// the idle reaper. It counts sessions' state and decides when it moves; the
// state store (state_store.h) makes, copies and releases it. The sessions'
// operations call it holding their session's lock.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "model.h"
#include "mutex.h"
#include "options.h"
#include "periodic_thread.h"
#include "session_state.h"
#include "state_store.h"

namespace aoti_sessions {

enum class OffloadCause { kRequest, kEviction, kIdle };

class Residency : public std::enable_shared_from_this<Residency>, public DeviceRoom {
 public:
  // Starts the idle reaper when options.idle_timeout_seconds is set.
  // `left_device` is told (under the session's lock) whenever a session's
  // state leaves its device block for good: offloaded, evicted or closed
  // (the runner drops what it captured with that block).
  using LeftDevice = std::function<void(const SessionState&)>;
  // `store`: where the sessions' state is kept.
  static std::shared_ptr<Residency> Create(std::shared_ptr<Model> model,
                                           std::shared_ptr<StateStore> store,
                                           const EngineOptions& options,
                                           LeftDevice left_device = nullptr);
  ~Residency();
  Residency(const Residency&) = delete;
  Residency& operator=(const Residency&) = delete;

  // Fills a new session's state (its device block, allocated; or its share of
  // the pool, empty: StateStore::Fill), with its lock held (`state.mutex().AssertHeld()` tells
  // the analysis) and before anyone else sees it.
  using Fill = std::function<void(SessionState& state, StreamHandle stream)>;
  // A new session of `bytes` (blocks: the block's size): counted against
  // max_sessions, device room reserved (by evicting idle sessions), its block
  // allocated and filled, and registered only once complete. Throws kCapacity
  // with the numbers (nothing allocated), kSessionClosed once the engine is
  // closing, kDevice.
  std::shared_ptr<SessionState> Admit(int64_t bytes, StreamHandle stream, const Fill& fill)
      EXCLUDES(registry_mutex_);
  // The same for a session made from `held` (a fork), whose lock the caller
  // holds: `held` is never evicted to make room for it.
  std::shared_ptr<SessionState> AdmitBeside(SessionState& held, int64_t bytes,
                                            StreamHandle stream, const Fill& fill)
      REQUIRES(held.mutex()) EXCLUDES(registry_mutex_);
  // The device room (DeviceRoom; drawn on through a PoolLease): `extra`
  // more device bytes for the resident sessions `held` (whose locks the
  // caller holds; none of them is evicted to make room), added to their
  // bytes() once their units are taken; or given back with Shrink. Throws
  // kCapacity as Admit does.
  void Reserve(const Held& held, int64_t extra, StreamHandle stream) override
      EXCLUDES(registry_mutex_);
  // Gives back `bytes` of device room (a reservation not used, or units a
  // resident session released).
  void Shrink(int64_t bytes) override EXCLUDES(registry_mutex_);

  // Moves the state to a host block and frees its device block; waits for the
  // state's work in flight. Throws kCapacity if host_budget is full. No-op
  // when offloaded.
  void Offload(SessionState& state, StreamHandle stream, OffloadCause cause)
      REQUIRES(state.mutex()) EXCLUDES(registry_mutex_);
  // Brings it back to the device, making room first (never by evicting one
  // of `also_held`, sessions whose locks the caller holds too). No-op when
  // resident.
  void Restore(SessionState& state, StreamHandle stream,
               const std::vector<const SessionState*>& also_held = {}) REQUIRES(state.mutex())
      EXCLUDES(registry_mutex_);
  // Closes the session and releases its memory once its queued work is done,
  // without blocking. Later operations fail naming `reason` (if any).
  void Release(SessionState& state, const std::string& reason) REQUIRES(state.mutex())
      EXCLUDES(registry_mutex_);

  // A session operation ended: wakes calls waiting for an idle session.
  void NotifyIdle() EXCLUDES(registry_mutex_);

  // Refuses new sessions, stops the reaper and closes every session (waiting
  // for each one's operation in flight). Reports the first failure.
  void Close() EXCLUDES(registry_mutex_);
  bool closed() const EXCLUDES(registry_mutex_);
  // Session counts, bytes per tier, tier counters and per-session entries.
  void AddStats(EngineStats& stats) const EXCLUDES(registry_mutex_);
  void AddMemory(MemoryReport& report) const EXCLUDES(registry_mutex_);

 private:
  Residency(std::shared_ptr<Model> model, std::shared_ptr<StateStore> store,
            const EngineOptions& options);
  std::shared_ptr<SessionState> AdmitFor(const Held& held, int64_t bytes, StreamHandle stream,
                                         const Fill& fill) EXCLUDES(registry_mutex_);
  // `host_credit`: host bytes the caller is about to release (a restore that
  // evicts: the swap leaves host use unchanged), allowed over host_budget.
  void OffloadWithCredit(SessionState& state, StreamHandle stream, OffloadCause cause,
                         int64_t host_credit) REQUIRES(state.mutex()) EXCLUDES(registry_mutex_);
  // Reserves `need` device bytes under memory_budget: offloads the least
  // recently used idle resident session (never one of `held`) while needed,
  // and waits for a session in use to finish when all are busy. Throws
  // kCapacity when room cannot be made. `host_credit` as for OffloadWithCredit.
  void ReserveDevice(const Held& held, int64_t need, StreamHandle stream, int64_t host_credit)
      EXCLUDES(registry_mutex_);
  // Closes the least recently used idle discardable session among
  // `candidates` (SessionState::discardable; not one of `held`, not waiting
  // for room; a resident one only, with `resident_only`): kDone, or kBusy
  // where every such session is in use now (a fork of it: idle soon), or
  // kNone where there is none.
  enum class Discard { kDone, kBusy, kNone };
  Discard DiscardLeastRecentlyUsed(std::vector<std::shared_ptr<SessionState>> candidates,
                                   const Held& held, bool resident_only) EXCLUDES(registry_mutex_);
  // Waits a moment for a session to become idle (NotifyIdle), with
  // registry_mutex_ held by `lock`.
  void WaitForIdle(MutexLock& lock) REQUIRES(registry_mutex_);
  // Offloads the least recently used idle session among `candidates`
  // (resident, not one of `held`, not waiting for room itself; a
  // discardable one is closed instead).
  enum class Eviction { kDone, kAllBusy, kNoCandidate };
  Eviction EvictLeastRecentlyUsed(std::vector<std::shared_ptr<SessionState>> candidates,
                                  const Held& held, StreamHandle stream,
                                  int64_t host_credit) EXCLUDES(registry_mutex_);
  // Offloads `victim` if it is idle (its lock is free); false if it is busy.
  bool TryEvict(SessionState& victim, StreamHandle stream, int64_t host_credit)
      EXCLUDES(registry_mutex_);
  // Removes a released session from the registry and its bytes from its tier.
  void Forget(uint64_t id, bool resident, int64_t bytes) EXCLUDES(registry_mutex_);
  // The reaper's round: offloads (or closes) sessions idle for idle_timeout.
  void ExpireIdle() EXCLUDES(registry_mutex_);
  std::vector<std::shared_ptr<SessionState>> OpenStatesRegistryLocked() const
      REQUIRES(registry_mutex_);
  // Tells the device how much freed memory to keep.
  void RetainRegistryLocked() REQUIRES(registry_mutex_);

  const std::shared_ptr<Model> model_;
  const std::shared_ptr<StateStore> store_;
  Device& device_;
  const int64_t block_bytes_;
  LeftDevice left_device_;  // set once, before any session exists
  const std::optional<int64_t> max_sessions_;
  const std::optional<int64_t> memory_budget_;
  const std::optional<int64_t> host_budget_;
  const std::optional<double> idle_timeout_seconds_;
  const IdleAction idle_action_;

  mutable Mutex registry_mutex_;
  std::unordered_map<uint64_t, std::weak_ptr<SessionState>> states_ GUARDED_BY(registry_mutex_);
  uint64_t next_session_id_ GUARDED_BY(registry_mutex_) = 1;
  int64_t live_sessions_ GUARDED_BY(registry_mutex_) = 0;
  int64_t device_bytes_ GUARDED_BY(registry_mutex_) = 0;  // resident, plus reservations in flight
  int64_t host_bytes_ GUARDED_BY(registry_mutex_) = 0;    // offloaded, plus reservations in flight
  int64_t offloaded_sessions_ GUARDED_BY(registry_mutex_) = 0;
  int64_t sessions_created_ GUARDED_BY(registry_mutex_) = 0;
  bool closed_ GUARDED_BY(registry_mutex_) = false;
  // Calls waiting for a resident session to become idle (waiting under
  // registry_mutex_); NotifyIdle skips the lock while there are none.
  std::condition_variable_any capacity_cv_;
  std::atomic<int> capacity_waiters_{0};

  // Counters for stats() only: no invariant ties them to anything.
  std::atomic<int64_t> offloads_{0};
  std::atomic<int64_t> evictions_{0};
  std::atomic<int64_t> idle_offloads_{0};
  std::atomic<int64_t> idle_closes_{0};
  std::atomic<int64_t> discards_{0};
  std::atomic<int64_t> restores_{0};

  std::unique_ptr<PeriodicThread> reaper_;  // the idle reaper, with idle_timeout
};

}  // namespace aoti_sessions
