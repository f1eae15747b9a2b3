// Per-session CUDA graphs: a session's run of a method captured once, with the
// session's state bound, and replayed after that without binding anything
// (docs/aoti-runtime.md, "CUDA graphs"). A graph keeps every address it was
// captured with, so it is replayed only while its key still holds: the same
// state block (a restore gives a new bind key), the same weight memory (a
// double-buffered update bumps the epoch), the same stream (graphs of one
// activation pool must not replay concurrently) and the same input shapes.
// Anything else recaptures lazily, at the session's next run. An owner keeps
// one graph per method and shape (a pooled method's batches: one per padded
// row count and bucketed shape), up to kGraphsPerMethod.
//
// The model allocates its intermediates and outputs through torch's caching
// allocator, whose routing into a graph pool has no C ABI: the caller supplies
// it as a GraphHost (the Python layer, through torch's own functions). This
// room holds the graphs and the pools; the runner decides when to capture and
// runs the model inside the capture.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "device.h"
#include "model.h"
#include "mutex.h"
#include "options.h"
#include "torch_shim.h"

namespace aoti_sessions {

// What a capture needs from torch beyond its C shim. Called from run threads
// with core locks held: an implementation must not call back into the engine.
class GraphHost {
 public:
  using Pool = std::pair<uint64_t, uint64_t>;  // torch's memory pool id
  virtual ~GraphHost() = default;
  virtual Pool NewPool() = 0;
  // Until EndAllocations: what the calling thread allocates through torch
  // (the model's run on `stream`) comes from `pool`.
  virtual void BeginAllocations(Pool pool, StreamHandle stream) = 0;
  virtual void EndAllocations(Pool pool) noexcept = 0;
  // Gives back one BeginAllocations' hold on the pool (torch counts them);
  // its memory goes back to torch once no hold and no tensor of it is left.
  virtual void ReleasePool(Pool pool) noexcept = 0;
  // A decision the user should hear of once (e.g. a method running eagerly).
  virtual void Note(const std::string& note) noexcept = 0;
};

struct GraphKey {
  uint64_t bind_key = 0;
  uint64_t weights_epoch = 0;
  StreamHandle stream = nullptr;
  std::vector<int64_t> shapes;  // every input's rank and sizes, in order
  bool operator==(const GraphKey& o) const {
    return bind_key == o.bind_key && weights_epoch == o.weights_epoch && stream == o.stream &&
           shapes == o.shapes;
  }
};

// Appends one input's rank and sizes to a graph key's `shapes`.
void AppendShapeKey(std::vector<int64_t>& shapes, const std::vector<int64_t>& sizes);

// Graphs of a pooled method's batched runs belong to no session: their owner
// is the padded row count (session ids count up from 1 and never get there).
inline uint64_t BatchGraphOwner(int64_t rows) { return UINT64_MAX - static_cast<uint64_t>(rows); }

// What a replay copies into one static input: the first `bytes` of it (a
// batch with fewer rows than the graph's fills a prefix), or nothing.
struct GraphInput {
  const void* data = nullptr;
  size_t bytes = 0;
};

// One session's captured run of one method.
struct Graph {
  GraphKey key;
  void* exec = nullptr;                   // the device's executable graph
  std::vector<OwnedTensor> inputs;        // static inputs, copied into before a replay
  std::vector<size_t> input_bytes;
  std::vector<OwnedTensor> outputs;       // in the pool; rewritten by every replay
  std::vector<TensorLayout> output_layouts;
  // The replay lock of the graph's pool (see PoolUse).
  std::mutex* replay_mutex = nullptr;
};

class GraphSet {
 public:
  // `host` may be null: then nothing is captured (C++ callers without torch's
  // allocator routing). With GraphMode::kOn a method with dynamic input shapes
  // is refused here (kInvalidArgument); with kAuto it runs eagerly, noted.
  GraphSet(Device& device, std::shared_ptr<GraphHost> host, GraphMode mode, bool output_views,
           const std::vector<Method>& methods);
  ~GraphSet();
  GraphSet(const GraphSet&) = delete;
  GraphSet& operator=(const GraphSet&) = delete;

  // Whether runs of `method` are captured (mode, device, host, static shapes,
  // and no failed capture so far). A pooled method's inputs may have dynamic
  // dimensions: its batches are captured per padded row count and per shape
  // (the runner buckets the rows and the page table's width; a caller that
  // varies another dimension buckets it, as the LLM scheduler pads prefill
  // chunks to powers of two).
  bool Captures(size_t method) const;
  // The session's graph of `method` if it was captured with `key`; graphs of
  // it captured with another bind key or weights epoch (never replayed
  // again) are destroyed. Call under the session's lock.
  Graph* Find(uint64_t session, size_t method, const GraphKey& key);
  // Captures the session's run of `method`: `run` queues the model's run on
  // the stream it is given (key.stream, or the device's capture stream for
  // the legacy default stream) with the static inputs it is given and
  // returns its outputs.
  // Nothing executes. Returns nullptr if the method cannot be captured (kAuto:
  // noted once, the method then runs eagerly); throws kRun under kOn.
  // (static inputs, the stream to queue the run on) -> outputs.
  // Inputs marked `in_place` (the pool's tensors) are captured as they are,
  // not copied: the graph keeps their memory's address.
  using RunFn = std::function<std::vector<OwnedTensor>(std::vector<OwnedTensor>, StreamHandle)>;
  Graph* Capture(uint64_t session, size_t method, GraphKey key,
                 const std::vector<OwnedTensor>& inputs, const RunFn& run,
                 const std::vector<bool>& in_place = {});
  // Queues a replay with `inputs` copied into the static inputs; returns
  // copies of the outputs (or, with output views, the graph's own: they are
  // rewritten by the next replay of any graph of the same stream).
  std::vector<OwnedTensor> Replay(Graph& graph, const std::vector<OwnedTensor>& inputs);
  // The same with each input's bytes given (a prefix of its static input;
  // none for an in-place one); with `rows` >= 0 the outputs are their first
  // `rows` rows (a padded batch).
  std::vector<OwnedTensor> Replay(Graph& graph, const std::vector<GraphInput>& inputs,
                                  int64_t rows);
  // Graphs kept per owner and method (shapes, streams); past it the one
  // captured first goes.
  static constexpr size_t kGraphsPerMethod = 128;
  // Destroys the session's graphs (it closed).
  void Forget(uint64_t session);
  // Destroys every graph and releases the pools; no run may be in flight on
  // the host (the device finishes replays in flight first).
  void Clear();

  int64_t replays() const { return replays_.load(); }
  int64_t captures() const { return captures_.load(); }
  int64_t live_graphs() const;
  int64_t pools() const;

 private:
  // Captures `run` (the work of `stream`) into `graph`: its outputs and
  // executable graph. Returns "" or why the capture failed (then nothing of
  // it is left).
  std::string Record(Graph& graph, StreamHandle stream, const RunFn& run);
  // Refuses `method` for graphs: a note (kAuto) or kRun (kOn).
  Graph* Refuse(size_t method, const std::string& why);
  // The pool of `stream` (made on first use) and its replay lock; counts one
  // hold the caller is about to take.
  std::pair<GraphHost::Pool, std::mutex*> PoolFor(StreamHandle stream);
  void Destroy(std::unique_ptr<Graph> graph) noexcept;

  Device& device_;
  const std::shared_ptr<GraphHost> host_;
  const GraphMode mode_;
  const bool output_views_;
  std::vector<std::string> method_names_;
  std::unique_ptr<std::atomic<bool>[]> captures_method_;  // per method
  // Serialises captures on the device's shared capture stream; held across a
  // capture (the GraphHost is called under it), so never under a leaf.
  std::mutex capture_mutex_;
  mutable Mutex mutex_;  // a leaf: the tables below, never a graph's contents
  // Per session, per method (index), oldest first; a graph's contents belong
  // to its session's lock holder.
  using Graphs = std::vector<std::unique_ptr<Graph>>;
  std::unordered_map<uint64_t, std::vector<Graphs>> graphs_ GUARDED_BY(mutex_);
  // One pool per capture stream, kept with every BeginAllocations' hold on
  // it until Clear (a graph's memory is reused by later captures there).
  struct PoolUse {
    GraphHost::Pool pool;
    int64_t holds = 0;
    // Graphs of a pool share memory: one graph's outputs may sit where
    // another, captured earlier, keeps its intermediates. Each replay queues
    // its input copies, launch and output copies under this lock (a leaf), so
    // no other replay of the pool comes between a launch and its copy-out.
    std::unique_ptr<std::mutex> replay_mutex = std::make_unique<std::mutex>();
  };
  std::map<StreamHandle, PoolUse> pools_ GUARDED_BY(mutex_);
  std::atomic<int64_t> replays_{0};
  std::atomic<int64_t> captures_{0};
};

}  // namespace aoti_sessions
