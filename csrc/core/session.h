// A session: one conversation's mutable state and the public operations on
// it. Every method of the engine runs against the same session state. Each
// operation holds the session's lock for its whole length, so a close (or an
// eviction) waits for the session's run in flight; it then calls the room
// that does the work (runner, residency, session files).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "device.h"
#include "model.h"
#include "pool_store.h"
#include "residency.h"
#include "runner.h"
#include "session_files.h"
#include "session_state.h"
#include "state_store.h"
#include "torch_shim.h"

namespace aoti_sessions {

// The rooms of one engine, shared by its facade and all its sessions (a
// session keeps them alive after the Engine object is gone).
struct EngineParts {
  std::shared_ptr<Model> model;
  std::shared_ptr<StateStore> store;  // a BlockStore, or a PoolStore (pooled state)
  std::shared_ptr<Runner> runner;
  std::shared_ptr<Residency> residency;
  std::shared_ptr<SessionFiles> files;
  // ProcessGeneration() when the engine was made.
  uint64_t process_generation = 0;

  // Whether this is a child process made by fork() after the engine was made:
  // the parent's threads are gone there and locks they held stay locked.
  bool in_forked_child() const;
  // Throws kOtherProcess in such a child (before any lock is taken).
  void CheckProcess() const;
};

// A host copy of one session's state at one moment (Session::Snapshot),
// written to a session file later, on any thread, while the session runs on:
// a checkpoint that holds the session only while its state is copied out.
// Keeps the engine's rooms alive.
class SessionSnapshot {
 public:
  // Writes the copy and `attachment` to a session file at `path`, as
  // Session::Save does (atomically; the same errors). May be called again.
  void Write(const std::string& path, const std::string& attachment = {}) const;
  // Bytes of state it holds.
  size_t bytes() const;

 private:
  friend class Session;
  explicit SessionSnapshot(std::shared_ptr<const EngineParts> parts) : parts_(std::move(parts)) {}

  std::shared_ptr<const EngineParts> parts_;  // (first: outlives the copy, its store's)
  HostCopy copy_;
};

class Session {
 public:
  // The session over a state Residency::Admit just made; releases the state
  // if making it fails, so nothing admitted is ever left behind.
  static std::shared_ptr<Session> Make(std::shared_ptr<const EngineParts> parts,
                                       std::shared_ptr<SessionState> state);
  Session(std::shared_ptr<const EngineParts> parts, std::shared_ptr<SessionState> state);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Unique for the life of the process; never reused.
  uint64_t id() const { return state_->id(); }
  // Whether this is a session of the engine whose rooms are `parts`.
  bool BelongsTo(const EngineParts& parts) const { return parts_.get() == &parts; }
  bool closed() const { return state_->closed(); }
  // Device address of this session's state block (diagnostics; nullptr once
  // closed, while offloaded, or when the model has no mutable state).
  const void* address() const;
  // Whether the state is in device memory (false while offloaded or closed).
  bool resident() const { return state_->resident(); }
  // When the session was last used (created, run, reset, written, restored),
  // in nanoseconds of the steady clock (CLOCK_MONOTONIC).
  int64_t last_use_ns() const { return state_->last_use_ns(); }

  // Whether the engine may close this session to make room
  // (SetDiscardable).
  bool discardable() const { return state_->discardable(); }
  // Lets the engine close the session when it needs room, instead of
  // offloading any session or refusing a new one (a cache's copy of a prefix,
  // which nobody's conversation holds): the least recently used idle one
  // goes first, before any other session is offloaded under memory_budget,
  // when a new session would pass max_sessions, and at idle_timeout (never
  // while a call holds it: a fork of it is safe). Forks are not discardable.
  void SetDiscardable(bool discardable);

  // Runs method `method` (Engine::method_index) on this session's state,
  // restoring it first if offloaded. Inputs are consumed. Throws
  // kInvalidArgument / kTypeMismatch for inputs that do not match the method
  // (before the model runs), kRun if the model fails.
  std::vector<OwnedTensor> Run(size_t method, std::vector<OwnedTensor>&& inputs,
                               StreamHandle stream = nullptr);
  // Back to the initial state.
  void Reset(StreamHandle stream = nullptr);
  // A new session whose state is a copy of this one's.
  std::shared_ptr<Session> Fork(StreamHandle stream = nullptr);
  // Copies mutable buffer `buffer` (Engine::buffer_index) into `dst`, which
  // must have the buffer's dtype, sizes and strides and live on the engine's
  // device or the host.
  void ReadBuffer(size_t buffer, AtenTensorHandle dst, StreamHandle stream = nullptr);
  // Copies every buffer at once (one per buffer, in engine order, each checked
  // like ReadBuffer's `dst`): one consistent snapshot, never a mix of two
  // states. Nothing is copied unless all destinations are valid.
  void ReadBuffers(const std::vector<AtenTensorHandle>& dsts, StreamHandle stream = nullptr);
  // Replaces every buffer at once: `sources[i]` is the new value of buffer
  // `fqns[i]`; every buffer must be given once (any order), each checked like
  // ReadBuffers' destinations. Nothing is written unless all of them are valid.
  void WriteBuffers(const std::vector<std::string>& fqns,
                    const std::vector<AtenTensorHandle>& sources, StreamHandle stream = nullptr);
  // Moves the state to host memory and releases its device memory; waits for
  // this session's work in flight. Throws kCapacity if host_budget is full.
  // No-op when already offloaded.
  void Offload(StreamHandle stream = nullptr);
  // Brings the state back to device memory, offloading idle sessions first if
  // memory_budget requires it. No-op when resident.
  void Restore(StreamHandle stream = nullptr);
  // Writes the state to a session file at `path` (see state_file.h),
  // atomically, with `attachment` (the caller's bytes, given back by
  // Engine::LoadSession; empty: none): Snapshot, then its Write. The session
  // is locked only while its state is copied out.
  void Save(const std::string& path, const std::string& attachment = {},
            StreamHandle stream = nullptr);
  // A host copy of the state as it is now, to be written later (the session
  // locked only while it is copied out). Throws kSessionClosed, or kDevice
  // when host memory for it cannot be had.
  std::shared_ptr<SessionSnapshot> Snapshot(StreamHandle stream = nullptr);
  // Releases the state once the work queued on it has finished, without
  // blocking. Waits for a run of this session in flight; idempotent.
  void Close();

  // -- pooled state (docs/batching.md; session_pooled.cc) -------------------
  // Positions the session holds (0 without pooled state).
  int64_t length();
  // Forgets the positions from `length` on (a rewind: kept ones are not
  // copied); pages wholly past it are released. A session with a slot (slot
  // state takes in every position) rewinds only to a checkpoint's length,
  // whose slot copy comes back; checkpoints past `length` go. Throws
  // kInvalidArgument for a length beyond the session's, and for a shorter one
  // a slot session has no checkpoint at.
  void Truncate(int64_t length, StreamHandle stream = nullptr);
  // Keeps a copy of the session's slot as it is now, at its length, so that
  // Truncate can rewind there; at most `keep` checkpoints stay, the oldest
  // going first. Each costs a slot's device bytes, counted as the session's.
  // They stay on the device only: an offload, a reset or a WritePool drops
  // them, and forks and saves do not carry them. Throws kInvalidArgument
  // without slot state or for keep < 1, kCapacity as a run's growth does.
  void Checkpoint(int64_t keep, StreamHandle stream = nullptr);
  // The lengths the session has checkpoints at, ascending.
  std::vector<int64_t> Checkpoints();
  // A copy of the session's part of every pooled tensor (`[units, ...]`, on
  // the engine's device) and its length: one snapshot.
  std::vector<OwnedTensor> ReadPool(int64_t* length, StreamHandle stream = nullptr);
  // Replaces the session's pooled state: `sources[i]` holds pooled tensor
  // `names[i]`'s units for a session of `length` positions (as ReadPool gives
  // them), every pooled tensor once. Nothing is written unless all are valid.
  void WritePool(const std::vector<std::string>& names,
                 const std::vector<AtenTensorHandle>& sources, int64_t length,
                 StreamHandle stream = nullptr);
  // Runs pooled `method` once over `rows` (one session of one engine per row,
  // in order, each at most once): `inputs` are the caller's, rows first; each
  // row's session is locked (in id order), restored if offloaded, and holds
  // the positions fed after the run. Throws as Run does, and kInvalidArgument
  // where a row would pass the sessions' context.
  static std::vector<OwnedTensor> RunBatch(const std::vector<std::shared_ptr<Session>>& rows,
                                           size_t method, std::vector<OwnedTensor>&& inputs,
                                           StreamHandle stream = nullptr);
  // A new session: in its initial state, or (`file` given) holding the
  // checked file's state (Engine::NewSession, Engine::LoadSession).
  static std::shared_ptr<Session> New(std::shared_ptr<const EngineParts> parts,
                                      SessionFiles::CheckedFile* file, StreamHandle stream);

 private:
  class OpLock;
  class BatchLock;
  // A run of a pooled method over `rows` (Run, RunBatch), every row's lock held.
  static std::vector<OwnedTensor> RunRowsLocked(const EngineParts& parts,
                                                const std::vector<SessionState*>& rows,
                                                size_t method, std::vector<OwnedTensor>&& inputs,
                                                StreamHandle stream);
  // The session restored (if offloaded), marked used and ordered on `stream`:
  // the start of every operation that changes its state.
  void Prepare(StreamHandle stream) REQUIRES(state_->mutex());
  // Checks `tensor` against buffer `buffer` (dtype, layout, device or host).
  void CheckBufferTensor(size_t buffer, AtenTensorHandle tensor, const char* role) const;
  // Copies the buffers `indices` into `dsts` (same order), checked first.
  void CopyOut(const std::vector<size_t>& indices, const std::vector<AtenTensorHandle>& dsts,
               StreamHandle stream);

  std::shared_ptr<const EngineParts> parts_;
  std::shared_ptr<SessionState> state_;
};

// The session's lock for one operation, after the process check. Releasing it
// tells the residency a session may have become idle (evictable).
class SCOPED_CAPABILITY Session::OpLock {
 public:
  explicit OpLock(const Session& s) ACQUIRE(s.state_->mutex())
      : parts_(*s.parts_), mutex_(s.state_->mutex()) {
    parts_.CheckProcess();
    mutex_.lock();
  }
  ~OpLock() RELEASE() {
    mutex_.unlock();
    parts_.residency->NotifyIdle();
  }
  OpLock(const OpLock&) = delete;
  OpLock& operator=(const OpLock&) = delete;

 private:
  const EngineParts& parts_;
  Mutex& mutex_;
};

}  // namespace aoti_sessions
