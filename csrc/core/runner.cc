// The run path: input checks, lanes (lease, bind-if-needed, warm-up counts),
// eager runs, captures and replays, reclaim of leaked bind handles. Weight
// updates are in runner_weights.cc.
#include "runner.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "errors.h"
#include "util.h"

namespace aoti_sessions {
namespace {

// The strides a tensor of `sizes` must have: `expected`, or contiguous ones
// when `expected` is empty.
std::vector<int64_t> WantedStrides(const std::vector<int64_t>& sizes,
                                   const std::vector<int64_t>& expected) {
  return expected.empty() ? ContiguousStrides(sizes) : expected;
}

// Whether `actual` addresses the same elements as `wanted`: strides of size-1
// dimensions never matter.
bool SameAddressing(const std::vector<int64_t>& sizes, const std::vector<int64_t>& actual,
                    const std::vector<int64_t>& wanted) {
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] != 1 && actual[i] != wanted[i]) return false;
  }
  return true;
}

}  // namespace

// Eager runs of a method on a lane and stream before the lane captures there:
// kernels load lazily on a container's first runs, which a capture must not
// contain (docs/aoti-runtime.md).
constexpr int kWarmUpRuns = 3;

// Torch and the libraries under it make some state lazily, per thread: cuBLAS
// and cuDNN handles, a cuBLAS workspace per stream, cuDNN's attention plans. A
// capture must not be a thread's first run of the method on the stream: that
// state would be made inside the capture, which fails (cuDNN:
// CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED) and leaves the method
// eager for good. So a lane captures only on a thread that has run the method
// eagerly on that stream with the same input shapes (cuDNN plans per shape).
// Per thread: (runner, method, stream, shapes) run eagerly here.
namespace {
struct ThreadRun {
  uint64_t runner;
  size_t method;
  StreamHandle stream;
  std::vector<int64_t> shapes;  // a graph key's shapes (every input's rank and sizes)
  bool operator==(const ThreadRun& o) const {
    return runner == o.runner && method == o.method && stream == o.stream && shapes == o.shapes;
  }
};
constexpr size_t kThreadRunsKept = 256;  // past this the list starts over (a few extra eager runs)
thread_local std::vector<ThreadRun> t_eager_runs;

bool RanEagerlyOnThisThread(const ThreadRun& run) {
  return std::find(t_eager_runs.begin(), t_eager_runs.end(), run) != t_eager_runs.end();
}

void NoteEagerRunOnThisThread(const ThreadRun& run) {
  if (RanEagerlyOnThisThread(run)) return;
  if (t_eager_runs.size() >= kThreadRunsKept) t_eager_runs.clear();
  t_eager_runs.push_back(run);
}
}  // namespace

static uint64_t NextRunnerId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

// A lane held for one run: picked, marked busy, and on release the handles
// of a fresh bind reclaimed (after the run is queued, so that on an
// asynchronous device the work overlaps the model's execution) before the lane
// is free again.
class Runner::LaneLease {
 public:
  LaneLease(Runner& runner, size_t method, uint64_t key, StreamHandle stream, bool want_warm)
      : runner_(runner), stream_(stream) {
    MutexLock lock(runner_.lanes_mutex_);
    while ((lane_ = Pick(runner_.lanes_[method], key, want_warm)) == nullptr) {
      lock.WaitFor(runner_.lane_freed_, std::chrono::milliseconds(100));
    }
    lane_->busy = true;
    lane_->last_use = ++runner_.lane_clock_;
    if (lane_->bound_key != key) lane_->bound_key = 0;  // until the bind succeeds
    warm_ = lane_->RunsOn(stream) >= kWarmUpRuns;
  }
  ~LaneLease() {
    const int64_t start = SteadyNowNs();
    try {
      lane_->container->ReclaimBindHandles(ErrorKind::kInternal);
    } catch (...) {
      // A failed extract only means a few handles stay leaked.
    }
    runner_.reclaim_nanoseconds_.fetch_add(SteadyNowNs() - start, std::memory_order_relaxed);
    {
      MutexLock lock(runner_.lanes_mutex_);
      lane_->busy = false;
    }
    runner_.lane_freed_.notify_all();
  }
  LaneLease(const LaneLease&) = delete;
  LaneLease& operator=(const LaneLease&) = delete;

  Lane& lane() const { return *lane_; }
  // Whether the lane ran the method kWarmUpRuns times on this stream.
  bool warm() const { return warm_; }
  void CountRun() {
    MutexLock lock(runner_.lanes_mutex_);
    for (auto& [s, n] : lane_->runs_on) {
      if (s == stream_) {
        n += n < kWarmUpRuns ? 1 : 0;
        return;
      }
    }
    lane_->runs_on.emplace_back(stream_, 1);
  }

 private:
  // The free lane to use: the one bound to `key` (warm on the stream, when
  // capturing), else the least recently used free one (warm ones first, when
  // capturing); nullptr if all are busy.
  Lane* Pick(std::vector<Lane>& lanes, uint64_t key, bool want_warm) const {
    Lane* bound = nullptr;
    Lane* lru = nullptr;
    Lane* lru_warm = nullptr;
    for (Lane& lane : lanes) {
      if (lane.busy) continue;
      const bool warm = lane.RunsOn(stream_) >= kWarmUpRuns;
      if (lane.bound_key == key && key != 0) bound = &lane;
      if (lru == nullptr || lane.last_use < lru->last_use) lru = &lane;
      if (warm && (lru_warm == nullptr || lane.last_use < lru_warm->last_use)) lru_warm = &lane;
      if (bound == &lane && (!want_warm || warm)) return bound;
    }
    if (want_warm && lru_warm != nullptr) return lru_warm;
    return bound != nullptr ? bound : lru;
  }

  Runner& runner_;
  StreamHandle stream_;
  Lane* lane_ = nullptr;
  bool warm_ = false;
};

Runner::Runner(std::shared_ptr<Model> model, std::vector<Lanes> lanes,
               const EngineOptions& options, std::shared_ptr<GraphHost> graph_host)
    : id_(NextRunnerId()),
      model_(std::move(model)),
      device_(model_->device()),
      lanes_per_method_(lanes.empty() ? 0 : static_cast<int64_t>(lanes[0].size())),
      graphs_(device_, std::move(graph_host), options.cuda_graphs, options.graph_output_views,
              model_->methods()) {
  for (Lanes& method_lanes : lanes) {
    lanes_.emplace_back(method_lanes.size());
    for (size_t i = 0; i < method_lanes.size(); ++i) {
      lanes_.back()[i].container = std::move(method_lanes[i]);
    }
  }
}

Runner::~Runner() { Close(); }

void Runner::Close() {
  WriterLock lock(weights_mutex_);
  closed_ = true;
  graphs_.Clear();
  lanes_.clear();
}

void Runner::CheckOpenLocked() const {
  if (closed_) Throw(ErrorKind::kSessionClosed, "the engine is closed");
}

void Runner::Forget(const SessionState& state) { graphs_.Forget(state.id()); }

void Runner::AddStats(EngineStats& s) const {
  s.runs = runs_.load();
  s.batch_runs = batch_runs_.load();
  s.batch_rows = batch_rows_.load();
  s.batch_nanoseconds = batch_nanoseconds_.load();
  s.binds = binds_.load();
  s.bind_nanoseconds = bind_nanoseconds_.load();
  s.reclaim_nanoseconds = reclaim_nanoseconds_.load();
  s.lanes = lanes_per_method_;
  s.graph_replays = graphs_.replays();
  s.graph_captures = graphs_.captures();
  s.graphs = graphs_.live_graphs();
  s.graph_pools = graphs_.pools();
}

void Runner::NoteStream(StreamHandle stream) {
  // Threads mostly keep to one stream: skip the shared lock when this thread
  // noted the same stream for this runner last time.
  thread_local uint64_t last_runner = 0;
  thread_local StreamHandle last_stream = nullptr;
  if (last_runner == id_ && last_stream == stream) return;
  last_runner = id_;
  last_stream = stream;
  MutexLock lock(lanes_mutex_);
  if (std::find(run_streams_.begin(), run_streams_.end(), stream) == run_streams_.end()) {
    run_streams_.push_back(stream);
  }
}

void Runner::ValidateInputs(const Method& method, std::vector<OwnedTensor>& inputs,
                            std::vector<int64_t>* shapes) const {
  if (inputs.size() != method.num_inputs) {
    Throw(ErrorKind::kInvalidArgument, "method '" + method.name + "' takes " +
                                           std::to_string(method.num_inputs) +
                                           " tensor inputs, got " + std::to_string(inputs.size()));
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::vector<int64_t> sizes = ValidateInput(method, i, inputs[i]);
    if (shapes != nullptr) AppendShapeKey(*shapes, sizes);
  }
}

std::vector<int64_t> Runner::ValidateInput(const Method& method, size_t i,
                                           OwnedTensor& input) const {
  const DeviceSpec& spec = device_.spec();
  {
    AtenTensorHandle tensor = input.get();
    std::string which = "input " + std::to_string(i) + " of method '" + method.name + "'";
    TensorLayout got = ReadLayout(tensor, which);
    int32_t type = DeviceType(tensor);
    int32_t index = DeviceIndex(tensor);
    if (type != device_.torch_device_type() ||
        (spec.kind == DeviceKind::kCuda && index != spec.index)) {
      Throw(ErrorKind::kInvalidArgument, which + " is on " + DeviceName(type, index) +
                                             ", but the engine runs on " + spec.ToString());
    }
    // Without a recorded spec the model checks itself; it was compiled for
    // contiguous inputs, so those still get their canonical strides below.
    const InputSpec* want = method.inputs ? &(*method.inputs)[i] : nullptr;
    if (want != nullptr) {
      if (got.dtype != want->dtype) {
        Throw(ErrorKind::kTypeMismatch, which + " has dtype " + DtypeName(got.dtype) +
                                            ", expected " + DtypeName(want->dtype));
      }
      bool shape_ok = got.sizes.size() == want->sizes.size();
      for (size_t d = 0; shape_ok && d < got.sizes.size(); ++d) {
        shape_ok = want->sizes[d] < 0 || want->sizes[d] == got.sizes[d];
      }
      if (!shape_ok) {
        Throw(ErrorKind::kInvalidArgument, which + " has shape " + FormatDims(got.sizes) +
                                               ", expected " + FormatDims(want->sizes) +
                                               " (* = any size)");
      }
    }
    std::vector<int64_t> wanted =
        WantedStrides(got.sizes, want != nullptr ? want->strides : std::vector<int64_t>{});
    if (!SameAddressing(got.sizes, got.strides, wanted)) {
      if (want == nullptr) return got.sizes;  // the model's own check decides
      Throw(ErrorKind::kInvalidArgument,
            which + " has strides " + FormatDims(got.strides) + ", expected " +
                (want->strides.empty() ? std::string("a contiguous tensor")
                                       : FormatDims(want->strides)));
    }
    // Same elements, other strides on size-1 dimensions (x[:, -1:] and the
    // like): hand the model the exact strides it was compiled for, as a view.
    if (got.strides != wanted) input = OwnedTensor::Restrided(tensor, wanted);
    return got.sizes;
  }
}

void Runner::BindLane(Lane& lane, size_t method, SessionState& state) {
  if (lane.bound_key == state.bind_key()) return;
  const int64_t start = SteadyNowNs();
  std::vector<AOTInductorConstantMapEntry> pairs;
  const auto& bindings = model_->methods()[method].state_bindings;
  pairs.reserve(bindings.size());
  for (const auto& [buffer, name] : bindings) {
    pairs.push_back({name.c_str(), state.tensors()[buffer].get()});
  }
  if (!pairs.empty()) lane.container->BindUserManaged(pairs, ErrorKind::kRun);
  {
    MutexLock lock(lanes_mutex_);
    lane.bound_key = state.bind_key();
  }
  binds_.fetch_add(1, std::memory_order_relaxed);
  bind_nanoseconds_.fetch_add(SteadyNowNs() - start, std::memory_order_relaxed);
}

std::vector<OwnedTensor> Runner::Run(SessionState& state, size_t method,
                                     std::vector<OwnedTensor>&& inputs, StreamHandle stream) {
  const Method& called = model_->method(method);  // throws for an unknown index
  const bool captures = graphs_.Captures(method);
  GraphKey key{state.bind_key(), 0, stream, {}};
  ValidateInputs(called, inputs, captures ? &key.shapes : nullptr);
  ReaderLock lock(weights_mutex_);
  CheckOpenLocked();
  DeviceScope scope(device_);
  NoteStream(stream);
  runs_.fetch_add(1, std::memory_order_relaxed);
  LaneRun how;
  how.bind_key = state.bind_key();
  how.bind = [&](Lane& lane) {
    state.mutex().AssertHeld();  // Run requires it
    BindLane(lane, method, state);
  };
  how.owner = state.id();
  if (!captures) return RunOnLane(method, how, inputs, stream, nullptr);
  key.weights_epoch = weights_epoch_;
  if (Graph* graph = graphs_.Find(state.id(), method, key)) return graphs_.Replay(*graph, inputs);
  return RunOnLane(method, how, inputs, stream, &key);
}

std::vector<OwnedTensor> Runner::RunOnLane(size_t method, const LaneRun& how,
                                           std::vector<OwnedTensor>& inputs, StreamHandle stream,
                                           GraphKey* key) {
  LaneLease lease(*this, method, how.bind_key, stream, key != nullptr);
  Lane& lane = lease.lane();
  how.bind(lane);
  Container& container = *lane.container;
  std::optional<ThreadRun> here;  // only where the run may capture
  if (key != nullptr) here = ThreadRun{id_, method, stream, key->shapes};
  if (here && lease.warm() && RanEagerlyOnThisThread(*here)) {
    // Nothing runs during the capture: the replay right after is this run
    // (the static inputs hold its inputs already).
    Graph* graph = graphs_.Capture(how.owner, method, std::move(*key), inputs,
                                   [&](std::vector<OwnedTensor> static_inputs, StreamHandle on) {
                                     return container.Run(std::move(static_inputs), on);
                                   },
                                   how.in_place);
    if (graph != nullptr) {
      return graphs_.Replay(*graph, std::vector<GraphInput>(inputs.size()), how.rows);
    }
  }
  std::vector<OwnedTensor> outputs = container.Run(std::move(inputs), stream);
  lease.CountRun();
  if (here) NoteEagerRunOnThisThread(*here);
  if (how.rows >= 0) {
    for (OwnedTensor& out : outputs) out = OwnedTensor::FirstRows(out.get(), how.rows);
  }
  return outputs;
}

}  // namespace aoti_sessions
