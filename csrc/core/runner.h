// The run path: the method containers, bound to one session's state at a time
// (a bind only when the session changed), input checks, runs, the reclaim of
// the handles torch leaks on every bind, and weight updates. One run lock
// serialises bind + run + weight updates for the whole engine: a container
// takes no lock of its own when rebinding (docs/aoti-runtime.md), and the
// methods share the held weights. This is the room per-session CUDA graphs and
// container lanes extend: what a run needs from a session is its state's
// tensors and bind key, nothing else.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "container.h"
#include "model.h"
#include "mutex.h"
#include "options.h"
#include "session_state.h"

namespace aoti_sessions {

class Runner {
 public:
  // Takes the containers Model::Load made, one per method in method order.
  Runner(std::shared_ptr<Model> model, std::vector<std::unique_ptr<Container>> containers);
  ~Runner();
  Runner(const Runner&) = delete;
  Runner& operator=(const Runner&) = delete;

  // Runs `method` on `state`, which must be resident. Inputs are consumed.
  // Throws kInvalidArgument / kTypeMismatch for inputs that do not match the
  // method (before the model runs), kRun if the model fails, kSessionClosed
  // once the engine is closed.
  std::vector<OwnedTensor> Run(SessionState& state, size_t method,
                               std::vector<OwnedTensor>&& inputs, StreamHandle stream)
      REQUIRES(state.mutex()) EXCLUDES(run_mutex_);

  // Copies CPU tensors into the held weights. Every update is validated (known
  // weight, dtype, sizes, strides, CPU memory) before anything is written.
  // In place: waits for runs in flight and blocks new ones until done.
  // double_buffer: fills new memory while runs go on, then rebinds every
  // method to it at once (no run sees a mix) and frees the old memory after
  // the runs that used it.
  void UpdateWeights(const std::vector<WeightUpdate>& updates, bool double_buffer)
      EXCLUDES(run_mutex_);

  // Waits for the run in flight and releases the containers; later runs and
  // updates throw kSessionClosed. Idempotent.
  void Close() EXCLUDES(run_mutex_);
  bool closed() const { return closed_.load(); }
  // runs, binds, bind and reclaim time.
  void AddStats(EngineStats& stats) const;

 private:
  // Checks inputs against the method (count, device, and the recorded specs);
  // may replace an input by a view with the exact strides the model expects.
  void ValidateInputs(const Method& method, std::vector<OwnedTensor>& inputs) const;
  // Checks every update; returns the held weight each one writes.
  std::vector<HeldWeight*> ValidateUpdates(const std::vector<WeightUpdate>& updates) const;
  // Binds `state` to the method's container unless it is bound already.
  void BindRunLocked(size_t method, SessionState& state) REQUIRES(run_mutex_, state.mutex());
  // Rebinds every method from the `targets`' memory to `fresh` (all or none)
  // and returns the memory replaced (owned by the store) for freeing.
  std::vector<void*> SwitchWeightsRunLocked(const std::vector<HeldWeight*>& targets,
                                            const std::vector<void*>& fresh) REQUIRES(run_mutex_);
  // Binds the weights of `method` that `tensors` names to the tensors there.
  void BindWeightsRunLocked(size_t method, const WeightTensors& tensors) REQUIRES(run_mutex_);
  // Blocks until the work queued by runs so far has finished.
  void SyncRunStreamsRunLocked() REQUIRES(run_mutex_);
  // Throws kSessionClosed once Close() released the containers.
  void CheckOpenRunLocked() const REQUIRES(run_mutex_);

  const std::shared_ptr<Model> model_;
  Device& device_;
  mutable Mutex run_mutex_;
  std::vector<std::unique_ptr<Container>> containers_ GUARDED_BY(run_mutex_);
  // Per method: SessionState::bind_key of the bound state; 0: none.
  std::vector<uint64_t> bound_keys_ GUARDED_BY(run_mutex_);
  std::vector<StreamHandle> run_streams_ GUARDED_BY(run_mutex_);  // streams runs were queued on
  // Whether Close() released the containers (written under run_mutex_, read
  // without it by closed()).
  std::atomic<bool> closed_{false};

  // Counters for stats() only.
  std::atomic<int64_t> runs_{0};
  std::atomic<int64_t> binds_{0};
  std::atomic<int64_t> bind_nanoseconds_{0};
  std::atomic<int64_t> reclaim_nanoseconds_{0};
};

}  // namespace aoti_sessions
