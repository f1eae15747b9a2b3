// Per-session CUDA graphs: capture around one run, replay with copies in and
// out, and the activation pools (one per capture stream).
#include "graphs.h"

#include <algorithm>

#include "errors.h"

namespace aoti_sessions {
namespace {

// The first input with a dynamic dimension, as "input I: [1, *]", or "".
// A pooled method's batches are captured per shape: none counts.
std::string DynamicInput(const Method& method) {
  if (!method.inputs || method.pool) return "";
  for (size_t i = 0; i < method.inputs->size(); ++i) {
    const std::vector<int64_t>& sizes = (*method.inputs)[i].sizes;
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (sizes[d] < 0) {
        return "input " + std::to_string(i) + " is " + FormatDims((*method.inputs)[i].sizes);
      }
    }
  }
  return "";
}

}  // namespace

void AppendShapeKey(std::vector<int64_t>& shapes, const std::vector<int64_t>& sizes) {
  shapes.push_back(static_cast<int64_t>(sizes.size()));
  shapes.insert(shapes.end(), sizes.begin(), sizes.end());
}

GraphSet::GraphSet(Device& device, std::shared_ptr<GraphHost> host, GraphMode mode,
                   bool output_views, const std::vector<Method>& methods)
    : device_(device),
      host_(std::move(host)),
      mode_(mode),
      output_views_(output_views),
      method_names_(),
      captures_method_(new std::atomic<bool>[methods.size()]) {
  const bool possible = mode_ != GraphMode::kOff && device_.supports_graphs() && host_ != nullptr;
  if (mode_ == GraphMode::kOn && !possible) {
    Throw(ErrorKind::kInvalidArgument,
          "cuda_graphs=True needs a CUDA device and a GraphHost routing torch's allocations "
          "(the Python layer passes one)");
  }
  for (size_t m = 0; m < methods.size(); ++m) {
    method_names_.push_back(methods[m].name);
    captures_method_[m] = possible;
    if (!possible) continue;
    std::string dynamic = DynamicInput(methods[m]);
    if (dynamic.empty()) continue;
    captures_method_[m] = false;
    std::string what = "method '" + methods[m].name + "' has dynamic input shapes (" + dynamic +
                       ")";
    if (mode_ == GraphMode::kOn) {
      Throw(ErrorKind::kInvalidArgument,
            "cuda_graphs=True: " + what + "; use cuda_graphs='auto' to run it eagerly");
    }
    host_->Note(what + ": it runs eagerly, without CUDA graphs");
  }
}

GraphSet::~GraphSet() { Clear(); }

bool GraphSet::Captures(size_t method) const { return captures_method_[method].load(); }

Graph* GraphSet::Find(uint64_t session, size_t method, const GraphKey& key) {
  Graphs stale;
  Graph* found = nullptr;
  {
    MutexLock lock(mutex_);
    auto it = graphs_.find(session);
    if (it == graphs_.end() || it->second.size() <= method) return nullptr;
    Graphs& graphs = it->second[method];
    Graphs kept;
    for (auto& graph : graphs) {
      if (graph->key == key) found = graph.get();
      const bool current = graph->key.bind_key == key.bind_key &&
                           graph->key.weights_epoch == key.weights_epoch;
      (current ? kept : stale).push_back(std::move(graph));
    }
    graphs.swap(kept);
  }
  for (auto& graph : stale) Destroy(std::move(graph));
  return found;
}

std::pair<GraphHost::Pool, std::mutex*> GraphSet::PoolFor(StreamHandle stream) {
  {
    MutexLock lock(mutex_);
    auto it = pools_.find(stream);
    if (it != pools_.end()) {
      ++it->second.holds;  // the caller begins allocations in it next
      return {it->second.pool, it->second.replay_mutex.get()};
    }
  }
  // The host is called without the lock held (it may take the GIL). A pool
  // made but never begun holds nothing in torch.
  GraphHost::Pool pool = host_->NewPool();
  MutexLock lock(mutex_);
  auto it = pools_.emplace(stream, PoolUse{pool}).first;
  ++it->second.holds;
  return {it->second.pool, it->second.replay_mutex.get()};
}

Graph* GraphSet::Capture(uint64_t session, size_t method, GraphKey key,
                         const std::vector<OwnedTensor>& inputs, const RunFn& run,
                         const std::vector<bool>& in_place) {
  auto graph = std::make_unique<Graph>();
  const int32_t type = device_.torch_device_type();
  const int32_t index = device_.spec().index;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (i < in_place.size() && in_place[i]) {
      graph->input_bytes.push_back(0);
      graph->inputs.push_back(OwnedTensor::Alias(inputs[i].get()));
      continue;
    }
    TensorLayout layout = ReadLayout(inputs[i].get());
    graph->input_bytes.push_back(layout.span_bytes());
    graph->inputs.push_back(OwnedTensor::Empty(layout, type, index));
    // A padded batch's replays fill a prefix: the rest keeps these values
    // (valid inputs, say token ids the embedding can index).
    if (graph->input_bytes.back() > 0) {
      device_.Copy(DataPtr(graph->inputs.back().get()), DataPtr(inputs[i].get()),
                   graph->input_bytes.back(), key.stream);
    }
  }
  const auto [pool, replay_mutex] = PoolFor(key.stream);
  graph->replay_mutex = replay_mutex;
  try {
    host_->BeginAllocations(pool, key.stream);
  } catch (const Error& e) {
    MutexLock lock(mutex_);
    --pools_[key.stream].holds;  // the hold PoolFor counted was never taken
    lock.Unlock();
    return Refuse(method, e.what());
  }
  std::string failure = Record(*graph, key.stream, run);
  host_->EndAllocations(pool);
  if (!failure.empty()) return Refuse(method, failure);
  for (const OwnedTensor& out : graph->outputs) graph->output_layouts.push_back(ReadLayout(out.get()));
  graph->key = std::move(key);
  captures_.fetch_add(1, std::memory_order_relaxed);
  Graph* result = graph.get();
  Graphs replaced;
  {
    MutexLock lock(mutex_);
    auto& slots = graphs_[session];
    if (slots.size() <= method) slots.resize(method_names_.size());
    Graphs& graphs = slots[method];
    for (auto it = graphs.begin(); it != graphs.end();) {
      if ((*it)->key == result->key) {  // a capture of a key Find did not see
        replaced.push_back(std::move(*it));
        it = graphs.erase(it);
      } else {
        ++it;
      }
    }
    while (graphs.size() >= kGraphsPerMethod) {  // the oldest goes
      replaced.push_back(std::move(graphs.front()));
      graphs.erase(graphs.begin());
    }
    graphs.push_back(std::move(graph));
  }
  for (auto& old : replaced) Destroy(std::move(old));
  return result;
}

std::string GraphSet::Record(Graph& graph, StreamHandle stream, const RunFn& run) {
  try {
    // The legacy default stream cannot be captured: its work is captured on
    // the device's private stream, one capture at a time, and replayed on it.
    StreamHandle capture = device_.CaptureStream(stream);
    std::unique_lock<std::mutex> one_at_a_time(capture_mutex_, std::defer_lock);
    if (capture != stream) one_at_a_time.lock();
    device_.BeginCapture(capture);
    try {
      std::vector<OwnedTensor> handles;
      for (const OwnedTensor& input : graph.inputs) handles.push_back(OwnedTensor::Alias(input.get()));
      graph.outputs = run(std::move(handles), capture);
      graph.exec = device_.EndCapture(capture);
    } catch (...) {
      device_.AbortCapture(capture);
      graph.outputs.clear();
      throw;
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

Graph* GraphSet::Refuse(size_t method, const std::string& why) {
  std::string what = "method '" + method_names_[method] +
                     "' cannot be captured into a CUDA graph: " + why;
  if (mode_ == GraphMode::kOn) Throw(ErrorKind::kRun, "cuda_graphs=True: " + what);
  if (captures_method_[method].exchange(false)) host_->Note(what + "; it runs eagerly");
  return nullptr;
}

std::vector<OwnedTensor> GraphSet::Replay(Graph& graph, const std::vector<OwnedTensor>& inputs) {
  std::vector<GraphInput> copies;
  copies.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    copies.push_back({DataPtr(inputs[i].get()), graph.input_bytes[i]});
  }
  return Replay(graph, copies, -1);
}

std::vector<OwnedTensor> GraphSet::Replay(Graph& graph, const std::vector<GraphInput>& inputs,
                                          int64_t rows) {
  StreamHandle stream = graph.key.stream;
  std::lock_guard<std::mutex> queued_together(*graph.replay_mutex);
  for (size_t i = 0; i < inputs.size(); ++i) {
    void* dst = DataPtr(graph.inputs[i].get());
    const size_t bytes = std::min(inputs[i].bytes, graph.input_bytes[i]);
    if (dst != inputs[i].data && bytes > 0) device_.Copy(dst, inputs[i].data, bytes, stream);
  }
  device_.Launch(graph.exec, stream);
  replays_.fetch_add(1, std::memory_order_relaxed);
  std::vector<OwnedTensor> outputs;
  outputs.reserve(graph.outputs.size());
  if (output_views_) {
    for (size_t i = 0; i < graph.outputs.size(); ++i) {
      outputs.push_back(rows < 0 ? OwnedTensor::Alias(graph.outputs[i].get())
                                 : OwnedTensor::FirstRows(graph.outputs[i].get(), rows));
    }
    return outputs;
  }
  // Copies, allocated for the run's stream and filled on it.
  TorchStreamScope scope(stream, device_.spec().index);
  for (size_t i = 0; i < graph.outputs.size(); ++i) {
    TensorLayout layout = graph.output_layouts[i];
    if (rows >= 0 && !layout.sizes.empty()) layout.sizes[0] = std::min(layout.sizes[0], rows);
    outputs.push_back(OwnedTensor::Empty(layout, device_.torch_device_type(), device_.spec().index));
    size_t bytes = layout.span_bytes();
    if (bytes > 0) {
      device_.Copy(DataPtr(outputs.back().get()), DataPtr(graph.outputs[i].get()), bytes, stream);
    }
  }
  return outputs;
}

void GraphSet::Destroy(std::unique_ptr<Graph> graph) noexcept {
  if (!graph) return;
  device_.DestroyGraph(graph->exec);
  graph->exec = nullptr;
  // The static tensors go back to torch's allocator: the pool's outputs stay
  // in the pool for later captures, ordered on its one stream.
}

void GraphSet::Forget(uint64_t session) {
  std::vector<Graphs> gone;
  {
    MutexLock lock(mutex_);
    auto it = graphs_.find(session);
    if (it == graphs_.end()) return;
    gone = std::move(it->second);
    graphs_.erase(it);
  }
  for (auto& graphs : gone) {
    for (auto& graph : graphs) Destroy(std::move(graph));
  }
}

void GraphSet::Clear() {
  std::unordered_map<uint64_t, std::vector<Graphs>> gone;
  std::map<StreamHandle, PoolUse> pools;
  {
    MutexLock lock(mutex_);
    gone.swap(graphs_);
    pools.swap(pools_);
  }
  for (auto& [session, methods] : gone) {
    for (auto& graphs : methods) {
      for (auto& graph : graphs) Destroy(std::move(graph));
    }
  }
  gone.clear();
  for (const auto& [stream, use] : pools) {
    for (int64_t i = 0; i < use.holds; ++i) host_->ReleasePool(use.pool);
  }
}

int64_t GraphSet::live_graphs() const {
  MutexLock lock(mutex_);
  int64_t n = 0;
  for (const auto& [session, methods] : graphs_) {
    for (const auto& graphs : methods) n += static_cast<int64_t>(graphs.size());
  }
  return n;
}

int64_t GraphSet::pools() const {
  MutexLock lock(mutex_);
  return static_cast<int64_t>(pools_.size());
}

}  // namespace aoti_sessions
