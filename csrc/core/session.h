// A session: one conversation's mutable state (a block of memory with every
// mutable buffer of the engine's model) and the operations on it. Every method
// of the engine runs against the same session state. The block lives in one of
// two tiers: resident (device memory, ready to run) or offloaded (host memory,
// pinned on CUDA); a run brings an offloaded session back first.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "device.h"
#include "torch_shim.h"

namespace aoti_sessions {

class Engine;

// Nanoseconds of the steady clock (CLOCK_MONOTONIC): the clock of last use.
int64_t SteadyNowNs();

class Session {
 public:
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Unique for the life of the process; never reused.
  uint64_t id() const { return id_; }
  bool closed() const;
  const std::shared_ptr<Engine>& engine() const { return engine_; }
  // Device address of this session's state block (diagnostics; nullptr once
  // closed, while offloaded, or when the model has no mutable state).
  const void* address() const;
  // Whether the state is in device memory (false while offloaded or closed).
  bool resident() const { return resident_.load(); }
  // When the session was last used (created, run, reset, written, restored),
  // in nanoseconds of the steady clock (CLOCK_MONOTONIC).
  int64_t last_use_ns() const { return last_use_ns_.load(); }

  // Runs method `method` (Engine::method_index) on this session's state. Inputs
  // are consumed. Throws kInvalidArgument / kTypeMismatch for inputs that do
  // not match the method (before the model runs), kRun if the model fails.
  std::vector<OwnedTensor> Run(size_t method, std::vector<OwnedTensor>&& inputs,
                               StreamHandle stream = nullptr);
  // Back to the initial state.
  void Reset(StreamHandle stream = nullptr);
  // A new session whose state is a copy of this one's.
  std::shared_ptr<Session> Fork(StreamHandle stream = nullptr);
  // Copies mutable buffer `buffer` (Engine::buffer_index) into `dst`, which must
  // have the buffer's dtype, sizes and strides and live on the engine's device
  // or the host.
  void ReadBuffer(size_t buffer, AtenTensorHandle dst, StreamHandle stream = nullptr);
  // Replaces every buffer at once from `sources` (one per buffer, in engine
  // order, each checked like ReadBuffer's `dst`). Nothing is written unless all
  // of them are valid.
  void WriteBuffers(const std::vector<AtenTensorHandle>& sources, StreamHandle stream = nullptr);
  // Moves the state to host memory and releases its device memory; waits for
  // this session's work in flight. Throws kCapacity if host_budget is full.
  // No-op when already offloaded.
  void Offload(StreamHandle stream = nullptr);
  // Brings the state back to device memory, offloading idle sessions first if
  // memory_budget requires it. No-op when resident.
  void Restore(StreamHandle stream = nullptr);
  // Writes the state to a session file at `path` (see state_file.h),
  // atomically. The session is locked only while its state is copied out.
  void Save(const std::string& path, StreamHandle stream = nullptr);
  // Releases the state once the work queued on it has finished, without
  // blocking. Waits for a run of this session in flight; idempotent.
  void Close();

 private:
  friend class Engine;
  class OpLock;
  Session(std::shared_ptr<Engine> engine, uint64_t id, void* block, StreamHandle stream,
          uint64_t bind_key);
  // Orders `stream` after this session's previous work; caller holds mutex_.
  void Use(StreamHandle stream);
  // Throws kSessionClosed if closed. Caller holds mutex_.
  void CheckOpen() const;
  void CheckBufferTensor(size_t buffer, AtenTensorHandle tensor, const char* role) const;
  // One tensor per buffer aliasing `block` (device memory).
  std::vector<OwnedTensor> AliasTensors(void* block) const;
  void Touch();
  // Closes with the lock held; `reason` (if any) is named by later errors.
  void CloseLocked(const std::string& reason);
  // Where the state is now: the device block or the host block.
  char* state() const { return static_cast<char*>(resident_ ? block_ : host_block_); }

  std::shared_ptr<Engine> engine_;
  const uint64_t id_;
  mutable std::mutex mutex_;  // serialises this session's runs and state operations
  std::atomic<bool> closed_{false};  // written under mutex_, read without
  std::string closed_reason_;        // under mutex_
  void* block_ = nullptr;     // device memory of all buffers (nullptr if none or offloaded)
  void* host_block_ = nullptr;  // host memory of all buffers while offloaded
  std::atomic<bool> resident_{true};  // written under mutex_, read without
  std::atomic<int64_t> last_use_ns_{0};
  // Set while the call holding this session waits in Engine::ReserveDevice:
  // it will not become idle before that call gets room.
  mutable std::atomic<bool> waiting_for_room_{false};
  // Identifies this session's current device block to the method containers:
  // a fresh one after every restore, so a stale binding is never reused.
  uint64_t bind_key_ = 0;
  StreamTracker stream_;      // the stream that last used the block
  // One tensor per mutable buffer, aliasing the block (what binds hand over).
  std::vector<OwnedTensor> tensors_;
};

}  // namespace aoti_sessions
