// A session: one conversation's mutable state (a block of device memory with
// every mutable buffer of the engine's model) and the operations on it. Every
// method of the engine runs against the same session state.
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
  // closed or when the model has no mutable state).
  const void* address() const;

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
  // Releases the state once the work queued on it has finished, without
  // blocking. Waits for a run of this session in flight; idempotent.
  void Close();

 private:
  friend class Engine;
  Session(std::shared_ptr<Engine> engine, uint64_t id, void* block, StreamHandle stream);
  // Orders `stream` after this session's previous work; caller holds mutex_.
  void Use(StreamHandle stream);
  // Throws kSessionClosed if closed. Caller holds mutex_.
  void CheckOpen() const;
  void CheckBufferTensor(size_t buffer, AtenTensorHandle tensor, const char* role) const;

  std::shared_ptr<Engine> engine_;
  const uint64_t id_;
  mutable std::mutex mutex_;  // serialises this session's runs and state operations
  std::atomic<bool> closed_{false};  // written under mutex_, read without
  void* block_ = nullptr;     // device memory of all buffers (nullptr if none)
  StreamTracker stream_;      // the stream that last used the block
  // One tensor per mutable buffer, aliasing the block (what binds hand over).
  std::vector<OwnedTensor> tensors_;
};

}  // namespace aoti_sessions
