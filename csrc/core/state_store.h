// Where sessions' state is kept, chosen once when the engine is made: each
// session in a block of its own (block_store.h), or a share of the engine's
// paged pool (pool_store.h). The residency, the sessions' operations and the
// engine call this interface and never ask which store it is; the store
// decides, holding the session's lock, how a state is made, reset, copied to
// the host and back, saved and released.
//
// Accounting: a session's bytes() are counted against memory_budget by the
// residency (a DeviceRoom here). A store that changes a resident session's
// size does it through a lease on that room (pool_store.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "device.h"
#include "host_pool.h"
#include "options.h"
#include "session_files.h"
#include "session_state.h"

namespace aoti_sessions {

class PoolStore;

// The device room sessions' state is counted in (memory_budget): the
// residency. Reserve makes room (offloading idle sessions other than `held`,
// whose locks the caller holds) or throws kCapacity; Shrink gives room back.
class DeviceRoom {
 public:
  using Held = std::vector<const SessionState*>;
  virtual ~DeviceRoom() = default;
  virtual void Reserve(const Held& held, int64_t bytes, StreamHandle stream) = 0;
  virtual void Shrink(int64_t bytes) = 0;
};

// A host copy of one session's state: a snapshot to be saved, or a session
// file's state before it becomes a session.
struct HostCopy {
  std::unique_ptr<HostBlock> block;  // a session block (block store)
  std::vector<char> packed;          // a share's units, packed (pool store)
  size_t pages = 0;                  // pages of the packed share
  int64_t length = -1;               // positions of the packed share (-1: a block)
  size_t bytes = 0;                  // of state held

  const void* data() const { return block ? block->get() : packed.data(); }
};

class StateStore {
 public:
  virtual ~StateStore() = default;

  // What a new session's state is made from: the initial state, another
  // session's (a fork: its lock held until the new one is filled) or a host
  // copy (a file's).
  struct Source {
    bool initial = true;
    const char* memory = nullptr;      // the state (device or host), unless `share`
    bool on_host = false;              // copies from `memory` end before the fill returns
    const PoolShare* share = nullptr;  // a resident session's share of the pool
    int64_t length = 0;                // its positions (pooled state)
    size_t pages = 0;                  // the pages they take
  };
  // The source a fork of `state` copies.
  virtual Source From(const SessionState& state) const REQUIRES(state.mutex()) = 0;
  // The source a host copy gives.
  static Source From(const HostCopy& copy);
  // Device bytes a session made from `source` starts with.
  virtual int64_t BytesOf(const Source& source) const = 0;
  // Fills a new session (its lock held, before anyone else sees it) from `source`.
  virtual void Fill(SessionState& made, const Source& source, StreamHandle stream)
      REQUIRES(made.mutex()) = 0;
  // Back to the initial state (a resident session); its bytes are settled in `room`.
  virtual void Reset(SessionState& state, DeviceRoom& room, StreamHandle stream)
      REQUIRES(state.mutex()) = 0;

  // -- tiers ----------------------------------------------------------------
  // Drops what a session keeps on the device only (pooled slot checkpoints)
  // before it leaves the device, settling its bytes in `room`.
  virtual void DropDeviceOnly(SessionState& state, DeviceRoom& room, StreamHandle stream)
      REQUIRES(state.mutex()) = 0;
  // A host copy of a resident state, for the offloaded tier; its device units
  // (not a block: the residency frees that) are given up.
  virtual void* ToHost(SessionState& state, StreamHandle stream) REQUIRES(state.mutex()) = 0;
  // The state's host copy back on the device: returns the new device block
  // (nullptr where the store keeps none), the host copy left for FreeHost.
  virtual void* ToDevice(SessionState& state, StreamHandle stream) REQUIRES(state.mutex()) = 0;
  // Frees a host copy ToHost made.
  virtual void FreeHost(void* host) = 0;
  // Gives up a closed session's units and host copy (`host`, if any) once the
  // work queued on `last` is done.
  virtual void Release(SessionState& state, void* host, StreamHandle last)
      REQUIRES(state.mutex()) = 0;

  // -- host copies and files -------------------------------------------------
  // An empty copy for CopyOut, made before the session is locked.
  virtual HostCopy NewHostCopy() = 0;
  // Copies the state into `copy` (waits for it).
  virtual void CopyOut(SessionState& state, HostCopy& copy, StreamHandle stream)
      REQUIRES(state.mutex()) = 0;
  // A session file checked against this store's state, and its state read.
  virtual SessionFiles::CheckedFile CheckFile(const SessionFiles& files, const std::string& path,
                                              bool strict) const = 0;
  virtual HostCopy ReadFile(const SessionFiles& files, SessionFiles::CheckedFile& file) = 0;
  virtual void WriteFile(SessionFiles& files, const std::string& path, const HostCopy& copy,
                         const std::string& attachment) const = 0;

  // -- engine-wide ------------------------------------------------------------
  // The pooled store, or kInvalidArgument `refusal` (an operation of pooled
  // state on an engine without one).
  virtual PoolStore& Pooled(const std::string& refusal) = 0;
  // Device bytes the store holds beside sessions' blocks (the pool).
  virtual size_t allocated_bytes() const = 0;
  // Host bytes kept spare for later copies.
  virtual size_t host_spare_bytes() const = 0;
  virtual void AddStats(EngineStats& stats) const = 0;
};

}  // namespace aoti_sessions
