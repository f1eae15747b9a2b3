// The run path: each method's containers ("lanes"), bound to one session's
// state at a time (a bind only when the session changed), input checks, runs,
// per-session CUDA graphs (graphs.h), the reclaim of the handles torch leaks
// on every bind, and weight updates. A lane is used by one run at a time (a
// container takes no lock of its own when rebinding, docs/aoti-runtime.md);
// a session keeps the lane it last ran on while no other run needs it (LRU),
// so switching between hot sessions binds nothing, and runs of different
// sessions go on at once on different lanes and streams. Graph replays need
// no lane at all. The weights lock is shared by runs and taken exclusively by
// weight updates and Close.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "container.h"
#include "graphs.h"
#include "model.h"
#include "mutex.h"
#include "options.h"
#include "session_state.h"
#include "state_pool.h"

namespace aoti_sessions {

// The addressing of one run of a pooled method (docs/batching.md): per row
// its page-table row, its position (length before the run) and slot, for the
// inputs the method takes; padding rows after the real ones.
struct PoolRows {
  int64_t rows = 0;                 // real rows (sessions)
  int64_t padded = 0;               // rows the model runs
  int64_t width = 0;                // of the page table
  std::vector<int32_t> page_table;  // padded x width
  std::vector<int64_t> positions;   // padded
  std::vector<int32_t> slot_ids;    // padded
};

// The padded row count a batch of `rows` runs as on a device with graphs:
// 1, 2, 4, then multiples of 8, at most `max_rows`.
int64_t BatchBucket(int64_t rows, int64_t max_rows);
// The page-table width a captured batch runs with where the method's width is
// dynamic: the next power of two, at most `max_pages`.
int64_t WidthBucket(int64_t width, int64_t max_pages);

class Runner {
 public:
  // Takes the lanes Model::Load made for each method (in method order).
  // `graph_host` may be null (no CUDA graphs).
  Runner(std::shared_ptr<Model> model, std::vector<Lanes> lanes, const EngineOptions& options,
         std::shared_ptr<GraphHost> graph_host);
  ~Runner();
  Runner(const Runner&) = delete;
  Runner& operator=(const Runner&) = delete;

  // Runs `method` on `state`, which must be resident: a replay of the
  // session's graph if it has a valid one, else on a lane (captured there
  // into a new graph once the lane is warm and the calling thread has run the
  // method eagerly on the stream, where the method captures).
  // Inputs are consumed. Throws kInvalidArgument / kTypeMismatch for inputs
  // that do not match the method (before the model runs), kRun if the model
  // fails, kSessionClosed once the engine is closed.
  std::vector<OwnedTensor> Run(SessionState& state, size_t method,
                               std::vector<OwnedTensor>&& inputs, StreamHandle stream)
      REQUIRES(state.mutex()) EXCLUDES(weights_mutex_, lanes_mutex_);

  // Runs pooled `method` over the sessions whose `shares` (one per row) hold
  // units for the positions written (taken beforehand); `inputs` are the
  // caller's, each with the rows first. The pool's tensors and the
  // addressing are filled in here. On a device with graphs the batch is
  // padded to BatchBucket rows and captured once per bucket, stream and pool
  // epoch. Throws as Run does.
  std::vector<OwnedTensor> RunPooled(size_t method, StatePool& pool,
                                     const std::vector<const PoolShare*>& shares,
                                     std::vector<OwnedTensor>&& inputs, StreamHandle stream)
      EXCLUDES(weights_mutex_, lanes_mutex_);

  // Forgets what the runner keeps for `state` (its graphs); it is closing.
  void Forget(const SessionState& state);
  // Whether runs of `method` are captured into CUDA graphs.
  bool Captures(size_t method) const { return graphs_.Captures(method); }

  // Copies CPU tensors into the held weights. Every update is validated (known
  // weight, dtype, sizes, strides, CPU memory) before anything is written.
  // In place: waits for runs in flight and blocks new ones until done (graphs
  // stay valid). double_buffer: fills new memory while runs go on, then
  // rebinds every lane of every method to it at once (no run sees a mix),
  // frees the old memory after the runs that used it, and graphs recapture.
  void UpdateWeights(const std::vector<WeightUpdate>& updates, bool double_buffer)
      EXCLUDES(weights_mutex_);

  // Waits for the runs in flight and releases graphs and containers; later
  // runs and updates throw kSessionClosed. Idempotent.
  void Close() EXCLUDES(weights_mutex_);
  bool closed() const { return closed_.load(); }
  // Counts `nanoseconds` a batch of pooled rows took in the core (its rows'
  // bookkeeping, pages and the run itself: Session::RunRowsLocked).
  void NoteBatchTime(int64_t nanoseconds) {
    batch_nanoseconds_.fetch_add(nanoseconds, std::memory_order_relaxed);
  }
  // runs, binds, bind and reclaim time, batches, lanes and graphs.
  void AddStats(EngineStats& stats) const;

 private:
  // One container of a method and what the runner knows of it.
  struct Lane {
    std::unique_ptr<Container> container;
    // Written under lanes_mutex_; the container itself belongs to the run
    // that marked the lane busy (or to the holder of the weights lock in
    // exclusive mode).
    uint64_t bound_key = 0;  // SessionState::bind_key bound; 0: none
    bool busy = false;
    uint64_t last_use = 0;   // lane clock
    std::vector<std::pair<StreamHandle, int>> runs_on;  // runs per stream (warm-up count)
    // Eager runs of the method on `stream` so far (counted up to the warm-up).
    int RunsOn(StreamHandle stream) const {
      for (const auto& [s, n] : runs_on) {
        if (s == stream) return n;
      }
      return 0;
    }
  };
  class LaneLease;

  // Checks inputs against the method (count, device, and the recorded specs);
  // may replace an input by a view with the exact strides the model expects.
  // With `shapes`, appends every input's sizes there (a graph key's shapes),
  // from the layouts the checks read.
  void ValidateInputs(const Method& method, std::vector<OwnedTensor>& inputs,
                      std::vector<int64_t>* shapes) const;
  // The same for input `index` alone; returns its sizes.
  std::vector<int64_t> ValidateInput(const Method& method, size_t index, OwnedTensor& input) const;
  // The phases of RunPooled (runner_pooled.cc). The caller's inputs checked
  // against the method and the batch's `rows`; returns their sizes.
  std::vector<std::vector<int64_t>> CheckBatch(const Method& called, int64_t rows,
                                               std::vector<OwnedTensor>& inputs) const;
  // The rows' addressing, padded to the bucket the run takes (with `captures`).
  PoolRows AddressRows(const Method& called, const StatePool& pool,
                       const std::vector<const PoolShare*>& shares, bool captures) const;
  // The graph key of the batch (inputs' shapes at the padded size).
  GraphKey BatchKey(const Method& called, const StatePool::Use& use, const PoolRows& rows,
                    const std::vector<std::vector<int64_t>>& sizes, StreamHandle stream) const
      REQUIRES_SHARED(weights_mutex_);
  // A replay of the bucket's graph: the inputs and the addressing copied in.
  std::vector<OwnedTensor> ReplayBatch(Graph& graph, const Method& called, const PoolRows& rows,
                                       const std::vector<OwnedTensor>& inputs);
  // The inputs as the model takes them: the caller's padded to the padded
  // rows, the pool's tensors, the addressing.
  std::vector<OwnedTensor> BatchInputs(const Method& method, const StatePool::Use& use,
                                       const PoolRows& rows, std::vector<OwnedTensor>& inputs,
                                       StreamHandle stream) const;
  // The run on a lane (captured there with `key`); the outputs keep the real rows.
  std::vector<OwnedTensor> RunBatchOnLane(size_t method, const PoolRows& rows,
                                          std::vector<OwnedTensor>& full, StreamHandle stream,
                                          GraphKey* key) REQUIRES_SHARED(weights_mutex_);
  // Checks every update; returns the held weight each one writes.
  std::vector<HeldWeight*> ValidateUpdates(const std::vector<WeightUpdate>& updates) const;
  // How a run uses its lane: the key the lane is bound with, what binds it
  // (the lane is the caller's for the run), the graph owner a capture
  // belongs to, inputs captured in place, and the rows of a padded batch
  // (-1: all) that the outputs keep.
  struct LaneRun {
    uint64_t bind_key = 0;
    std::function<void(Lane&)> bind;
    uint64_t owner = 0;
    std::vector<bool> in_place;
    int64_t rows = -1;
  };
  // Runs on a lane: eagerly, or (with `key`) captured into the owner's graph
  // and replayed.
  std::vector<OwnedTensor> RunOnLane(size_t method, const LaneRun& how,
                                     std::vector<OwnedTensor>& inputs, StreamHandle stream,
                                     GraphKey* key) REQUIRES_SHARED(weights_mutex_);
  // Binds `state` to `lane` (a lane the caller holds) unless bound already.
  void BindLane(Lane& lane, size_t method, SessionState& state) REQUIRES(state.mutex());
  // Rebinds every lane from the `targets`' memory to `fresh` (all or none)
  // and returns the memory replaced (owned by the store) for freeing.
  std::vector<void*> SwitchWeightsLocked(const std::vector<HeldWeight*>& targets,
                                         const std::vector<void*>& fresh) REQUIRES(weights_mutex_);
  // Binds the weights of `method` that `tensors` names to the tensors there,
  // in every lane of the method.
  void BindWeightsLocked(size_t method, const WeightTensors& tensors) REQUIRES(weights_mutex_);
  // Blocks until the work queued by runs so far has finished.
  void SyncRunStreams() EXCLUDES(lanes_mutex_);
  void NoteStream(StreamHandle stream) EXCLUDES(lanes_mutex_);
  // Throws kSessionClosed once Close() released the containers.
  void CheckOpenLocked() const REQUIRES_SHARED(weights_mutex_);

  const uint64_t id_;  // unique in the process (a per-thread cache keys on it)
  const std::shared_ptr<Model> model_;
  Device& device_;
  mutable SharedMutex weights_mutex_;
  uint64_t weights_epoch_ GUARDED_BY(weights_mutex_) = 0;  // bumped when weights move
  // Per method; the vectors never change size until Close (exclusive).
  std::vector<std::vector<Lane>> lanes_;
  const int64_t lanes_per_method_;
  mutable Mutex lanes_mutex_;  // a leaf: lane fields and the stream list
  std::condition_variable_any lane_freed_;
  uint64_t lane_clock_ GUARDED_BY(lanes_mutex_) = 0;
  std::vector<StreamHandle> run_streams_ GUARDED_BY(lanes_mutex_);  // streams runs were queued on
  GraphSet graphs_;
  // Whether Close() released the containers (written under the weights lock
  // held exclusively, read without it by closed()).
  std::atomic<bool> closed_{false};

  // Counters for stats() only.
  std::atomic<int64_t> runs_{0};
  std::atomic<int64_t> binds_{0};
  std::atomic<int64_t> bind_nanoseconds_{0};
  std::atomic<int64_t> reclaim_nanoseconds_{0};
  std::atomic<int64_t> batch_runs_{0};
  std::atomic<int64_t> batch_rows_{0};
  std::atomic<int64_t> batch_nanoseconds_{0};
};

}  // namespace aoti_sessions
