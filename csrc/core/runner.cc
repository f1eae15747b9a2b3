// The run path: input checks, bind-if-needed, run, reclaim of leaked bind
// handles. Weight updates, which share its lock, are in runner_weights.cc.
#include "runner.h"

#include <algorithm>

#include "errors.h"
#include "util.h"

namespace aoti_sessions {
namespace {

// The strides a tensor of `sizes` must have: `expected`, or contiguous ones
// when `expected` is empty.
std::vector<int64_t> WantedStrides(const std::vector<int64_t>& sizes,
                                   const std::vector<int64_t>& expected) {
  if (!expected.empty()) return expected;
  std::vector<int64_t> strides(sizes.size());
  int64_t step = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = step;
    step *= sizes[i];
  }
  return strides;
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

// Makes the engine's device current on the calling thread for a scope.
class DeviceScope {
 public:
  explicit DeviceScope(Device& device) : device_(device), previous_(device.Enter()) {}
  ~DeviceScope() { device_.Leave(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  Device& device_;
  int previous_;
};

}  // namespace

Runner::Runner(std::shared_ptr<Model> model, std::vector<std::unique_ptr<Container>> containers)
    : model_(std::move(model)), device_(model_->device()) {
  MutexLock lock(run_mutex_);
  containers_ = std::move(containers);
  bound_keys_.assign(containers_.size(), 0);
}

Runner::~Runner() { Close(); }

void Runner::Close() {
  MutexLock lock(run_mutex_);
  closed_ = true;
  containers_.clear();
}

void Runner::CheckOpenRunLocked() const {
  if (closed_) Throw(ErrorKind::kSessionClosed, "the engine is closed");
}

void Runner::AddStats(EngineStats& s) const {
  s.runs = runs_.load();
  s.binds = binds_.load();
  s.bind_nanoseconds = bind_nanoseconds_.load();
  s.reclaim_nanoseconds = reclaim_nanoseconds_.load();
}

void Runner::ValidateInputs(const Method& method, std::vector<OwnedTensor>& inputs) const {
  if (inputs.size() != method.num_inputs) {
    Throw(ErrorKind::kInvalidArgument, "method '" + method.name + "' takes " +
                                           std::to_string(method.num_inputs) +
                                           " tensor inputs, got " + std::to_string(inputs.size()));
  }
  const DeviceSpec& spec = device_.spec();
  for (size_t i = 0; i < inputs.size(); ++i) {
    AtenTensorHandle tensor = inputs[i].get();
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
      if (want == nullptr) continue;  // the model's own check decides
      Throw(ErrorKind::kInvalidArgument,
            which + " has strides " + FormatDims(got.strides) + ", expected " +
                (want->strides.empty() ? std::string("a contiguous tensor")
                                       : FormatDims(want->strides)));
    }
    // Same elements, other strides on size-1 dimensions (x[:, -1:] and the
    // like): hand the model the exact strides it was compiled for, as a view.
    if (got.strides != wanted) inputs[i] = OwnedTensor::Restrided(tensor, wanted);
  }
}

void Runner::BindRunLocked(size_t method, SessionState& state) {
  if (bound_keys_[method] == state.bind_key()) return;
  const int64_t start = SteadyNowNs();
  bound_keys_[method] = 0;  // unknown until the bind succeeds
  std::vector<AOTInductorConstantMapEntry> pairs;
  const auto& bindings = model_->methods()[method].state_bindings;
  pairs.reserve(bindings.size());
  for (const auto& [buffer, name] : bindings) {
    pairs.push_back({name.c_str(), state.tensors()[buffer].get()});
  }
  if (!pairs.empty()) containers_[method]->BindUserManaged(pairs, ErrorKind::kRun);
  bound_keys_[method] = state.bind_key();
  binds_.fetch_add(1, std::memory_order_relaxed);
  bind_nanoseconds_.fetch_add(SteadyNowNs() - start, std::memory_order_relaxed);
}

std::vector<OwnedTensor> Runner::Run(SessionState& state, size_t method,
                                     std::vector<OwnedTensor>&& inputs, StreamHandle stream) {
  ValidateInputs(model_->method(method), inputs);
  MutexLock lock(run_mutex_);
  CheckOpenRunLocked();
  DeviceScope scope(device_);
  BindRunLocked(method, state);
  runs_.fetch_add(1, std::memory_order_relaxed);
  if (std::find(run_streams_.begin(), run_streams_.end(), stream) == run_streams_.end()) {
    run_streams_.push_back(stream);
  }
  Container& container = *containers_[method];
  // Reclaim the handles of a fresh bind after the run is queued, so that on an
  // asynchronous device the work overlaps the model's execution.
  struct ReclaimAfterRun {
    Container& container;
    std::atomic<int64_t>& nanoseconds;
    ~ReclaimAfterRun() {
      const int64_t start = SteadyNowNs();
      try {
        container.ReclaimBindHandles(ErrorKind::kInternal);
      } catch (...) {
        // A failed extract only means a few handles stay leaked.
      }
      nanoseconds.fetch_add(SteadyNowNs() - start, std::memory_order_relaxed);
    }
  } reclaim{container, reclaim_nanoseconds_};
  return container.Run(std::move(inputs), stream);
}

}  // namespace aoti_sessions
