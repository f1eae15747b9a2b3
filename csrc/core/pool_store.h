// The pool store (docs/batching.md): sessions' state as shares of the
// engine's paged pool (state_pool.h), which it owns; a share packed to host
// memory while offloaded, saved as its pooled tensors (session file version
// 2). A resident share changes size only through a PoolLease, which keeps the
// device room the residency counts in step with the units taken.
#pragma once

#include <memory>
#include <optional>

#include "model.h"
#include "state_pool.h"
#include "state_store.h"

namespace aoti_sessions {

class PoolStore final : public StateStore {
 public:
  // `max_bytes` caps the pool's memory (memory_budget), if set.
  PoolStore(std::shared_ptr<Model> model, std::optional<int64_t> max_bytes);

  StatePool& pool() { return pool_; }
  const PoolLayout& layout() const { return pool_.layout(); }
  // Device bytes `state` grows by when it takes `count` more positions.
  int64_t Growth(const SessionState& state, int64_t count) const REQUIRES(state.mutex());

  Source From(const SessionState& state) const override REQUIRES(state.mutex());
  int64_t BytesOf(const Source& source) const override;
  void Fill(SessionState& made, const Source& source, StreamHandle stream) override
      REQUIRES(made.mutex());
  void Reset(SessionState& state, DeviceRoom& room, StreamHandle stream) override
      REQUIRES(state.mutex());

  void DropDeviceOnly(SessionState& state, DeviceRoom& room, StreamHandle stream) override
      REQUIRES(state.mutex());
  void* ToHost(SessionState& state, StreamHandle stream) override REQUIRES(state.mutex());
  void* ToDevice(SessionState& state, StreamHandle stream) override REQUIRES(state.mutex());
  void FreeHost(void* host) override { device_.FreeHost(host); }
  void Release(SessionState& state, void* host, StreamHandle last) override
      REQUIRES(state.mutex());

  HostCopy NewHostCopy() override { return {}; }
  void CopyOut(SessionState& state, HostCopy& copy, StreamHandle stream) override
      REQUIRES(state.mutex());
  SessionFiles::CheckedFile CheckFile(const SessionFiles& files, const std::string& path,
                                      bool strict) const override;
  HostCopy ReadFile(const SessionFiles& files, SessionFiles::CheckedFile& file) override;
  void WriteFile(SessionFiles& files, const std::string& path, const HostCopy& copy,
                 const std::string& attachment) const override;

  PoolStore& Pooled(const std::string&) override { return *this; }
  size_t allocated_bytes() const override { return pool_.allocated_bytes(); }
  size_t host_spare_bytes() const override { return 0; }
  void AddStats(EngineStats& stats) const override { pool_.AddStats(stats); }

 private:
  const std::shared_ptr<Model> model_;
  Device& device_;
  StatePool pool_;
};

// Device room for resident sessions' units, the accounting done together:
// the room reserved when the lease is made (idle sessions other than `held`
// offloaded for it), each session's units taken and its bytes settled out of
// it, and what is left (all of it on a failure) given back when the lease
// ends. A session that gives units up gives their room back through it (a
// lease of nothing reserved).
class PoolLease {
 public:
  PoolLease(PoolStore& store, DeviceRoom& room, const DeviceRoom::Held& held, int64_t bytes,
            StreamHandle stream);
  PoolLease(PoolStore& store, DeviceRoom& room) : store_(store), room_(room) {}
  ~PoolLease();
  PoolLease(const PoolLease&) = delete;
  PoolLease& operator=(const PoolLease&) = delete;

  // `count` more positions for `state`: new pages for them, and a copy of
  // each shared page they fall in (copy on write).
  void Grow(SessionState& state, int64_t count, StreamHandle stream) REQUIRES(state.mutex());
  // Fresh pages (`pages`, unwritten) replace the session's, which holds
  // `length` positions then.
  void Replace(SessionState& state, size_t pages, int64_t length, StreamHandle stream)
      REQUIRES(state.mutex());
  // A copy of the session's slot at its length (Session::Checkpoint).
  void Checkpoint(SessionState& state, StreamHandle stream) REQUIRES(state.mutex());
  // Releases the pages past the session's length (a session holds the pages
  // of its positions, no more: its host copy's layout relies on it).
  void Trim(SessionState& state, StreamHandle stream) REQUIRES(state.mutex());
  // Releases checkpoints [first, last).
  void DropCheckpoints(SessionState& state, size_t first, size_t last, StreamHandle stream)
      REQUIRES(state.mutex());
  // Back to an empty share with a zeroed slot.
  void Reset(SessionState& state, StreamHandle stream) REQUIRES(state.mutex());

 private:
  // `state` holds `bytes` now: its growth comes out of the lease, what it
  // shrank by goes back into it.
  void Settle(SessionState& state, int64_t bytes) REQUIRES(state.mutex());

  PoolStore& store_;
  DeviceRoom& room_;
  int64_t left_ = 0;  // reserved and not yet settled
};

}  // namespace aoti_sessions
