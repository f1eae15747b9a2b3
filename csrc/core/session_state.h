// One session's state: its block of memory in one of two tiers (resident in
// device memory, or offloaded to host memory), the key that identifies the
// block to the method containers, the stream that last used it, and the lock
// that serialises every operation on it. With pooled state (state_pool.h)
// there is no block: the session owns a share of the pool while resident,
// and a packed host copy of it while offloaded. This class is the only writer of
// those fields; the residency and the session's operations change them
// through it, holding its lock.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "device.h"
#include "mutex.h"
#include "state_pool.h"
#include "torch_shim.h"

namespace aoti_sessions {

class SessionState {
 public:
  // A resident state in `block` (device memory; nullptr when the model has no
  // state), with `tensors` aliasing each buffer in it, last used on `stream`.
  // `bytes`: its size in either tier (see bytes()).
  SessionState(uint64_t id, void* block, std::vector<OwnedTensor> tensors, StreamHandle stream,
               int64_t bytes);
  SessionState(const SessionState&) = delete;
  SessionState& operator=(const SessionState&) = delete;

  // Unique for the life of the process; never reused.
  uint64_t id() const { return id_; }
  // Serialises this session's operations (see the locking order in engine.h).
  Mutex& mutex() const RETURN_CAPABILITY(mutex_) { return mutex_; }

  // Readable without the lock: each mirrors a field written under it, so the
  // answer may be stale by the time it is used (eviction checks again).
  bool closed() const { return closed_.load(); }
  bool resident() const { return resident_.load(); }
  int64_t last_use_ns() const { return last_use_ns_.load(); }
  // Bytes of its state, counted against the budget of the tier it is in (a
  // block's size; with pooled state its pages and slot, shared pages
  // counted by every owner).
  int64_t bytes() const { return bytes_.load(); }
  // True while the call holding the lock waits for device room: the session
  // will not become idle before that call gets it.
  bool waiting_for_room() const { return waiting_for_room_.load(); }
  // Whether the engine may close it to make room (a cache's copy of a
  // prefix, nobody's conversation): before any session is offloaded for
  // device room, instead of refusing a new session at max_sessions, and at
  // idle_timeout. Set under the lock; read without it, then again under it.
  bool discardable() const { return discardable_.load(); }
  // The stream that last queued work on the state (thread-safe).
  StreamHandle last_stream() const { return stream_.last(); }

  // Throws kSessionClosed, with the reason it was closed for, if closed.
  void CheckOpen() const REQUIRES(mutex_);
  // Where the state is now: the device block or, offloaded, the host block.
  char* memory() const REQUIRES(mutex_);
  void* device_block() const REQUIRES(mutex_) { return block_; }
  // Identifies the current device block to the containers: a fresh key after
  // every restore, so a binding to a freed block is never reused.
  uint64_t bind_key() const REQUIRES(mutex_) { return bind_key_; }
  // One tensor per mutable buffer aliasing the device block (what binds hand over).
  const std::vector<OwnedTensor>& tensors() const REQUIRES(mutex_) { return tensors_; }
  // Marks the session used now (last_use).
  void Touch() REQUIRES(mutex_);
  // Orders `stream` after the state's previous work.
  void Use(Device& device, StreamHandle stream) REQUIRES(mutex_);
  void set_waiting_for_room(bool waiting) REQUIRES(mutex_) { waiting_for_room_ = waiting; }
  void set_bytes(int64_t bytes) REQUIRES(mutex_) { bytes_ = bytes; }
  void set_discardable(bool discardable) REQUIRES(mutex_) { discardable_ = discardable; }
  // Its part of the pooled state (empty without one; while offloaded only
  // the length is kept, the units are in the host copy).
  PoolShare& share() REQUIRES(mutex_) { return share_; }
  const PoolShare& share() const REQUIRES(mutex_) { return share_; }

  // Tier moves. To host: takes `host_block` (holding a copy of the state) and
  // returns the device block, for the caller to free.
  void* MoveToHost(void* host_block) REQUIRES(mutex_);
  // To the device: takes `block` (holding a copy of the state) and its
  // aliasing tensors, and returns the host block, for the caller to recycle.
  void* MoveToDevice(void* block, std::vector<OwnedTensor> tensors) REQUIRES(mutex_);
  // Closes; later operations fail naming `reason` (if any). Returns the
  // memory the caller must release. Closing twice returns nothing.
  struct Released {
    void* device_block = nullptr;
    void* host_block = nullptr;
    bool was_open = false;
    bool was_resident = false;
  };
  Released Close(const std::string& reason) REQUIRES(mutex_);

 private:
  const uint64_t id_;
  mutable Mutex mutex_;
  std::atomic<bool> closed_{false};
  std::atomic<bool> resident_{true};
  std::atomic<int64_t> last_use_ns_{0};
  std::atomic<bool> waiting_for_room_{false};
  std::atomic<int64_t> bytes_{0};
  std::atomic<bool> discardable_{false};
  std::string closed_reason_ GUARDED_BY(mutex_);
  void* block_ GUARDED_BY(mutex_) = nullptr;       // device memory (nullptr if none or offloaded)
  void* host_block_ GUARDED_BY(mutex_) = nullptr;  // host memory while offloaded
  uint64_t bind_key_ GUARDED_BY(mutex_) = 0;
  std::vector<OwnedTensor> tensors_ GUARDED_BY(mutex_);
  PoolShare share_ GUARDED_BY(mutex_);
  StreamTracker stream_;
};

}  // namespace aoti_sessions
