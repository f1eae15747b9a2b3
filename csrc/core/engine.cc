// Engine loading (methods, mutable-state selection, descriptors, templates),
// capacity accounting, input validation and the bind-if-needed run path.
#include "engine.h"

#include <fnmatch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <set>
#include <unordered_set>

#include "errors.h"
#include "session.h"

namespace aoti_sessions {
namespace {

constexpr size_t kBlockAlignment = 256;

size_t AlignUp(size_t n) { return (n + kBlockAlignment - 1) / kBlockAlignment * kBlockAlignment; }

std::string DeviceName(int32_t type, int32_t index) {
  const TorchShim& s = Shim();
  if (type == s.device_type_cpu) return "cpu";
  if (type == s.device_type_cuda) return "cuda:" + std::to_string(index);
  return "device type " + std::to_string(type);
}

std::string JoinNames(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

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

int64_t ElapsedNanoseconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                              start)
      .count();
}

std::string ShapeString(const std::vector<int64_t>& sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    s += (i ? ", " : "") + (sizes[i] < 0 ? std::string("*") : std::to_string(sizes[i]));
  }
  return s + "]";
}

}  // namespace

std::shared_ptr<Engine> Engine::Create(const std::vector<MethodSource>& methods,
                                       const EngineOptions& options) {
  std::shared_ptr<Engine> engine(new Engine());
  engine->Load(methods, options);
  engine->StartReaper();
  return engine;
}

Engine::~Engine() {
  StopReaper();
  for (void* block : spare_host_) device_->FreeHost(block);
  spare_host_.clear();
  methods_.clear();
  weights_.reset();
  parking_tensors_.clear();
  try {
    if (template_block_ != nullptr) device_->Free(template_block_, template_stream_.last());
    if (parking_ != nullptr) device_->Free(parking_, nullptr);
  } catch (...) {
    // A broken device runtime (say a sticky CUDA error) must not abort teardown.
  }
}

void Engine::Load(const std::vector<MethodSource>& sources, const EngineOptions& options) {
  if (sources.empty()) Throw(ErrorKind::kInvalidArgument, "an engine needs at least one method");
  if (options.max_sessions < -1 || options.max_sessions == 0) {
    Throw(ErrorKind::kInvalidArgument,
          "max_sessions must be positive, got " + std::to_string(options.max_sessions));
  }
  if (options.memory_budget < -1) {
    Throw(ErrorKind::kInvalidArgument,
          "memory_budget must be >= 0 bytes, got " + std::to_string(options.memory_budget));
  }
  if (options.host_budget < -1) {
    Throw(ErrorKind::kInvalidArgument,
          "host_budget must be >= 0 bytes, got " + std::to_string(options.host_budget));
  }
  if (!(options.idle_timeout_seconds >= 0) || !std::isfinite(options.idle_timeout_seconds)) {
    Throw(ErrorKind::kInvalidArgument, "idle_timeout must be >= 0 seconds, got " +
                                           std::to_string(options.idle_timeout_seconds));
  }
  options_ = options;
  device_ = OpenDevice(DeviceSpec::Parse(options.device));
  const DeviceSpec& spec = device_->spec();

  std::set<std::string> names;
  std::unordered_map<std::string, std::shared_ptr<ModelLibrary>> libraries;
  for (const MethodSource& source : sources) {
    if (source.name.empty() || !names.insert(source.name).second) {
      Throw(ErrorKind::kInvalidArgument, "method names must be unique and non-empty, got '" +
                                             source.name + "' twice or empty");
    }
    auto& library = libraries[source.library_path];
    if (!library) library = ModelLibrary::Open(source.library_path);
    bool wants_cuda = spec.kind == DeviceKind::kCuda;
    if (library->targets_cuda() != wants_cuda) {
      Throw(ErrorKind::kPackage, "method '" + source.name + "' (" + source.library_path +
                                     ") was compiled for " +
                                     (library->targets_cuda() ? "cuda" : "cpu") +
                                     ", but the engine's device is " + spec.ToString());
    }
    Method method;
    method.name = source.name;
    method.library_path = source.library_path;
    method.container =
        std::make_unique<Container>(library, spec, source.cubin_dir, options.reclaim_bind_handles);
    if (source.inputs && source.inputs->size() != method.container->num_inputs()) {
      Throw(ErrorKind::kPackage, "method '" + source.name + "' declares " +
                                     std::to_string(source.inputs->size()) +
                                     " input specs, but its model takes " +
                                     std::to_string(method.container->num_inputs()));
    }
    if (source.inputs) {
      for (const InputSpec& input : *source.inputs) {
        if (!input.strides.empty() && input.strides.size() != input.sizes.size()) {
          Throw(ErrorKind::kPackage, "method '" + source.name +
                                         "' declares an input spec whose strides and sizes "
                                         "differ in length");
        }
      }
    }
    method.inputs = source.inputs;
    method.weights_file = source.weights;
    file_stamps_.emplace(source.library_path, StampFile(source.library_path));
    if (source.weights) file_stamps_.emplace(source.weights->path, StampFile(source.weights->path));
    method.call_spec = {method.container->in_spec(), method.container->out_spec()};
    method.num_inputs = method.container->num_inputs();
    methods_.push_back(std::move(method));
  }
  SelectMutable(options);
  HoldWeights();
  CaptureTemplates();
  FinishWeights();
}

void Engine::SelectMutable(const EngineOptions& options) {
  // Every non-folded constant FQN, in order of first appearance.
  std::vector<std::string> fqns;
  std::set<std::string> seen;
  std::set<std::string> buffer_typed;
  for (const Method& method : methods_) {
    for (const ConstantInfo& c : method.container->constants()) {
      if (c.from_folded) continue;
      if (seen.insert(c.fqn).second) fqns.push_back(c.fqn);
      if (c.type == abi::ConstantType::kBuffer) buffer_typed.insert(c.fqn);
    }
  }
  std::set<std::string> selected;
  if (options.mutable_patterns) {
    for (const std::string& pattern : *options.mutable_patterns) {
      bool matched = false;
      for (const std::string& fqn : fqns) {
        if (fnmatch(pattern.c_str(), fqn.c_str(), 0) == 0) {
          selected.insert(fqn);
          matched = true;
        }
      }
      if (!matched) {
        Throw(ErrorKind::kPackage, "mutable FQN '" + pattern +
                                       "' matches no constant of any method (" +
                                       JoinNames(method_names()) + ")");
      }
    }
  } else {
    selected = buffer_typed;
  }
  for (const std::string& fqn : options.known_mutated) {
    if (!selected.count(fqn)) {
      Throw(ErrorKind::kPackage, "buffer '" + fqn +
                                     "' is mutated by the model but not in the mutable set, so "
                                     "sessions would share it; add it to mutable=");
    }
  }
  for (const std::string& fqn : fqns) {
    if (!selected.count(fqn)) continue;
    buffer_index_[fqn] = buffers_.size();
    MutableBuffer buffer;
    buffer.fqn = fqn;
    buffers_.push_back(std::move(buffer));
  }
}

void Engine::CaptureTemplates() {
  StreamHandle stream = nullptr;
  // Where each buffer's initial value lives (the first method that has it).
  std::vector<const void*> initial(buffers_.size(), nullptr);
  std::vector<std::string> first_method(buffers_.size());
  for (size_t m = 0; m < methods_.size(); ++m) {
    Method& method = methods_[m];
    auto values = InitialValues(method);
    for (const ConstantInfo& c : method.container->constants()) {
      auto index = buffer_index_.find(c.fqn);
      if (c.from_folded || index == buffer_index_.end()) continue;
      MutableBuffer& buffer = buffers_[index->second];
      auto value = values.find(c.fqn);
      if (value == values.end()) {
        Throw(ErrorKind::kPackage, "method '" + method.name + "' lists constant '" + c.fqn +
                                       "' but holds no tensor for it");
      }
      const TensorLayout& layout = value->second.layout;
      if (initial[index->second] == nullptr) {
        if (!layout.dense()) {
          Throw(ErrorKind::kPackage, "mutable buffer '" + c.fqn + "' has a layout (" +
                                         layout.ToString() +
                                         ") that is not dense; such buffers are not supported");
        }
        buffer.layout = layout;
        buffer.bytes = layout.span_bytes();
        initial[index->second] = value->second.data;
        first_method[index->second] = method.name;
      } else if (layout != buffer.layout) {
        Throw(ErrorKind::kPackage, "mutable buffer '" + c.fqn + "' is " +
                                       buffer.layout.ToString() + " in method '" +
                                       first_method[index->second] + "' but " +
                                       layout.ToString() + " in method '" + method.name + "'");
      }
      buffer.methods.push_back(method.name);
      method.bindings.emplace_back(index->second, c.name);
    }
  }
  // Lay out a session block: buffers with a non-zero initial value first, so
  // that initialising a block is one copy of that prefix plus one memset.
  for (size_t i = 0; i < buffers_.size(); ++i) {
    buffers_[i].zero_initial = device_->IsZero(initial[i], buffers_[i].bytes, stream);
  }
  size_t offset = 0;
  for (bool zero : {false, true}) {
    for (MutableBuffer& buffer : buffers_) {
      if (buffer.zero_initial != zero) continue;
      buffer.offset = offset;
      offset += AlignUp(buffer.bytes);
    }
    if (!zero) nonzero_prefix_bytes_ = offset;
  }
  block_bytes_ = offset;
  if (nonzero_prefix_bytes_ > 0) {
    template_block_ = device_->Allocate(nonzero_prefix_bytes_, stream);
    template_bytes_ = nonzero_prefix_bytes_;
    auto* base = static_cast<char*>(template_block_);
    device_->Zero(base, nonzero_prefix_bytes_, stream);  // alignment padding
    for (size_t i = 0; i < buffers_.size(); ++i) {
      if (!buffers_[i].zero_initial) {
        device_->Copy(base + buffers_[i].offset, initial[i], buffers_[i].bytes, stream);
      }
    }
    device_->Synchronize(stream);
  }
}

std::vector<std::string> Engine::method_names() const {
  std::vector<std::string> names;
  for (const Method& m : methods_) names.push_back(m.name);
  return names;
}

size_t Engine::method_index(const std::string& name) const {
  for (size_t i = 0; i < methods_.size(); ++i) {
    if (methods_[i].name == name) return i;
  }
  Throw(ErrorKind::kInvalidArgument,
        "unknown method '" + name + "'; this engine has: " + JoinNames(method_names()));
}

const Engine::Method& Engine::MethodAt(size_t method) const {
  if (method >= methods_.size()) {
    Throw(ErrorKind::kInvalidArgument, "method index " + std::to_string(method) +
                                           " out of range (" + std::to_string(methods_.size()) +
                                           " methods)");
  }
  return methods_[method];
}

const std::pair<std::string, std::string>& Engine::call_spec(size_t method) const {
  return MethodAt(method).call_spec;
}

size_t Engine::num_inputs(size_t method) const { return MethodAt(method).num_inputs; }

size_t Engine::buffer_index(const std::string& fqn) const {
  auto it = buffer_index_.find(fqn);
  if (it == buffer_index_.end()) {
    Throw(ErrorKind::kInvalidArgument, "'" + fqn + "' is not a mutable buffer of this engine");
  }
  return it->second;
}

EngineStats Engine::stats() const {
  EngineStats s;
  std::vector<std::shared_ptr<Session>> open;  // released after the lock
  {
    std::lock_guard<std::mutex> lock(sessions_mutex_);
    s.live_sessions = live_sessions_;
    s.device_bytes = device_bytes_;
    s.host_bytes = host_bytes_;
    s.live_bytes = device_bytes_ + host_bytes_;
    s.offloaded_sessions = offloaded_sessions_;
    s.resident_sessions = live_sessions_ - offloaded_sessions_;
    s.sessions_created = sessions_created_;
    open = OpenSessionsLocked();
  }
  for (const auto& session : open) {
    s.sessions.push_back({session->id(), session->resident(),
                          static_cast<int64_t>(block_bytes_), session->last_use_ns()});
  }
  std::sort(s.sessions.begin(), s.sessions.end(),
            [](const SessionStats& a, const SessionStats& b) { return a.id < b.id; });
  s.host_spare_bytes = static_cast<int64_t>(HostSpareBytes());
  s.offloads = offloads_.load();
  s.evictions = evictions_.load();
  s.idle_offloads = idle_offloads_.load();
  s.idle_closes = idle_closes_.load();
  s.restores = restores_.load();
  s.saves = saves_.load();
  s.loads = loads_.load();
  s.runs = runs_.load();
  s.binds = binds_.load();
  s.bind_nanoseconds = bind_nanoseconds_.load();
  s.reclaim_nanoseconds = reclaim_nanoseconds_.load();
  return s;
}

bool Engine::closed() const {
  std::lock_guard<std::mutex> lock(sessions_mutex_);
  return closed_;
}

std::shared_ptr<Session> Engine::NewSession(StreamHandle stream) {
  return CreateSession(stream, nullptr);
}

std::shared_ptr<Session> Engine::CreateSession(StreamHandle stream, const void* copy_from,
                                               bool from_host, const Session* held) {
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(sessions_mutex_);
    if (closed_) Throw(ErrorKind::kSessionClosed, "the engine is closed");
    if (options_.max_sessions >= 0 && live_sessions_ >= options_.max_sessions) {
      Throw(ErrorKind::kCapacity, "max_sessions=" + std::to_string(options_.max_sessions) +
                                      " reached: " + std::to_string(live_sessions_) +
                                      " sessions are open");
    }
    ++live_sessions_;
    id = next_session_id_++;
  }
  try {
    ReserveDevice(held, stream);
  } catch (...) {
    std::lock_guard<std::mutex> lock(sessions_mutex_);
    --live_sessions_;
    throw;
  }
  void* block = nullptr;
  std::shared_ptr<Session> session;
  try {
    if (block_bytes_ > 0) {
      block = device_->Allocate(block_bytes_, stream);
      if (copy_from != nullptr) {
        device_->Copy(block, copy_from, block_bytes_, stream);
        // The host source may be reused once the caller lets go of it.
        if (from_host) device_->Synchronize(stream);
      } else {
        InitializeBlock(block, stream);
      }
    }
    session.reset(new Session(shared_from_this(), id, block, stream, next_bind_key_++));
  } catch (...) {
    // Nothing was handed to a session: release the block and the reservation.
    if (block != nullptr) {
      try {
        device_->Free(block, stream);
      } catch (...) {
      }
    }
    Forget(id, true);
    throw;
  }
  {
    std::lock_guard<std::mutex> lock(sessions_mutex_);
    if (!closed_) {
      sessions_[id] = session;
      ++sessions_created_;
      return session;
    }
  }
  // The engine closed while this session was being made: it must not outlive it.
  session->Close();
  Throw(ErrorKind::kSessionClosed, "the engine is closed");
}

void Engine::InitializeBlock(void* block, StreamHandle stream) {
  auto* base = static_cast<char*>(block);
  if (nonzero_prefix_bytes_ > 0) {
    template_stream_.Use(*device_, stream);
    device_->Copy(base, template_block_, nonzero_prefix_bytes_, stream);
  }
  if (block_bytes_ > nonzero_prefix_bytes_) {
    device_->Zero(base + nonzero_prefix_bytes_, block_bytes_ - nonzero_prefix_bytes_, stream);
  }
}

void Engine::ReleaseSession(Session& session) {
  session.tensors_.clear();
  const bool resident = session.resident_;
  session.resident_ = false;
  void* block = std::exchange(session.block_, nullptr);
  GiveHostBlock(std::exchange(session.host_block_, nullptr));
  try {
    // Freed in the order of the last stream that used it: after its runs finish.
    if (block != nullptr) device_->Free(block, session.stream_.last());
  } catch (...) {
    Forget(session.id_, resident);
    throw;
  }
  Forget(session.id_, resident);
}

void Engine::Forget(uint64_t session_id, bool resident) {
  std::lock_guard<std::mutex> lock(sessions_mutex_);
  sessions_.erase(session_id);
  --live_sessions_;
  if (resident) {
    device_bytes_ -= static_cast<int64_t>(block_bytes_);
  } else {
    host_bytes_ -= static_cast<int64_t>(block_bytes_);
    --offloaded_sessions_;
  }
  RetainLocked();
}

void Engine::RetainLocked() {
  // The device keeps what weights, live sessions and templates use plus one
  // spare block, so churn (close one, create one) costs a memset or a copy,
  // not a fresh mapping of device memory; anything beyond goes back.
  device_->Retain(weight_bytes() + parking_bytes_ + static_cast<size_t>(device_bytes_) +
                  template_bytes_ + block_bytes_);
}

void Engine::Close() {
  std::vector<std::shared_ptr<Session>> open;
  {
    std::lock_guard<std::mutex> lock(sessions_mutex_);
    if (closed_) return;
    closed_ = true;
    open = OpenSessionsLocked();
  }
  StopReaper();
  // Close everything even if one session fails; report the first failure.
  std::exception_ptr first;
  for (auto& session : open) {
    try {
      session->Close();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  {
    std::lock_guard<std::mutex> lock(run_mutex_);
    for (Method& method : methods_) method.container.reset();
  }
  if (first) std::rethrow_exception(first);
}

void Engine::ValidateInputs(const Method& method, std::vector<OwnedTensor>& inputs) const {
  if (inputs.size() != method.num_inputs) {
    Throw(ErrorKind::kInvalidArgument, "method '" + method.name + "' takes " +
                                           std::to_string(method.num_inputs) +
                                           " tensor inputs, got " + std::to_string(inputs.size()));
  }
  const DeviceSpec& spec = device_->spec();
  for (size_t i = 0; i < inputs.size(); ++i) {
    AtenTensorHandle tensor = inputs[i].get();
    std::string which = "input " + std::to_string(i) + " of method '" + method.name + "'";
    int32_t type = DeviceType(tensor);
    int32_t index = DeviceIndex(tensor);
    if (type != device_->torch_device_type() ||
        (spec.kind == DeviceKind::kCuda && index != spec.index)) {
      Throw(ErrorKind::kInvalidArgument, which + " is on " + DeviceName(type, index) +
                                             ", but the engine runs on " + spec.ToString());
    }
    TensorLayout got = ReadLayout(tensor);
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
        Throw(ErrorKind::kInvalidArgument, which + " has shape " + ShapeString(got.sizes) +
                                               ", expected " + ShapeString(want->sizes) +
                                               " (* = any size)");
      }
    }
    std::vector<int64_t> wanted =
        WantedStrides(got.sizes, want != nullptr ? want->strides : std::vector<int64_t>{});
    if (!SameAddressing(got.sizes, got.strides, wanted)) {
      if (want == nullptr) continue;  // the model's own check decides
      Throw(ErrorKind::kInvalidArgument,
            which + " has strides " + ShapeString(got.strides) + ", expected " +
                (want->strides.empty() ? std::string("a contiguous tensor")
                                       : ShapeString(want->strides)));
    }
    // Same elements, other strides on size-1 dimensions (x[:, -1:] and the
    // like): hand the model the exact strides it was compiled for, as a view.
    if (got.strides != wanted) inputs[i] = OwnedTensor::Restrided(tensor, wanted);
  }
}

std::vector<OwnedTensor> Engine::RunLocked(Session& session, size_t method_index,
                                           std::vector<OwnedTensor>&& inputs,
                                           StreamHandle stream) {
  MethodAt(method_index);  // checks the index
  Method& method = methods_[method_index];
  std::lock_guard<std::mutex> lock(run_mutex_);
  if (!method.container) Throw(ErrorKind::kSessionClosed, "the engine is closed");
  ValidateInputs(method, inputs);
  struct DeviceScope {
    Device& device;
    int previous;
    explicit DeviceScope(Device& d) : device(d), previous(d.Enter()) {}
    ~DeviceScope() { device.Leave(previous); }
  } scope(*device_);
  if (method.bound_key != session.bind_key_) {
    auto start = std::chrono::steady_clock::now();
    method.bound_key = 0;  // unknown until the bind succeeds
    std::vector<AOTInductorConstantMapEntry> pairs;
    pairs.reserve(method.bindings.size());
    for (const auto& [buffer, name] : method.bindings) {
      pairs.push_back({name.c_str(), session.tensors_[buffer].get()});
    }
    if (!pairs.empty()) method.container->BindUserManaged(pairs);
    method.bound_key = session.bind_key_;
    binds_.fetch_add(1, std::memory_order_relaxed);
    bind_nanoseconds_.fetch_add(ElapsedNanoseconds(start), std::memory_order_relaxed);
  }
  runs_.fetch_add(1, std::memory_order_relaxed);
  if (std::find(run_streams_.begin(), run_streams_.end(), stream) == run_streams_.end()) {
    run_streams_.push_back(stream);
  }
  // Reclaim the handles of a fresh bind after the run is queued, so that on an
  // asynchronous device the work overlaps the model's execution.
  struct ReclaimAfterRun {
    Engine& engine;
    Container& container;
    ~ReclaimAfterRun() {
      auto start = std::chrono::steady_clock::now();
      try {
        container.ReclaimBindHandles();
      } catch (...) {
        // A failed extract only means a few handles stay leaked.
      }
      engine.reclaim_nanoseconds_.fetch_add(ElapsedNanoseconds(start), std::memory_order_relaxed);
    }
  } reclaim{*this, *method.container};
  return method.container->Run(std::move(inputs), stream);
}

// ---------------------------------------------------------------- weights

namespace {

const WeightEntry* FindEntry(const WeightsFile& file, const std::string& fqn) {
  for (const WeightEntry& e : file.entries) {
    if (e.fqn == fqn) return &e;
  }
  return nullptr;
}

std::string FileKey(const WeightsFile& file, const WeightEntry& entry) {
  return file.path + ":" + std::to_string(entry.offset);
}

}  // namespace

std::unordered_map<std::string, Engine::InitialValue> Engine::InitialValues(Method& method) {
  std::unordered_map<std::string, InitialValue> values;
  if (method.weights_file) {
    for (const ConstantInfo& c : method.container->constants()) {
      if (c.from_folded || !buffer_index_.count(c.fqn)) continue;
      const WeightEntry* entry = FindEntry(*method.weights_file, c.fqn);
      if (entry == nullptr) continue;  // reported as missing by the caller
      std::vector<char>& host = file_initial_[FileKey(*method.weights_file, *entry)];
      if (host.size() != entry->bytes) {
        host.resize(entry->bytes);
        ReadFileRange(method.weights_file->path, entry->offset, entry->bytes, host.data());
      }
      values[c.fqn] = InitialValue{entry->layout, host.data()};
    }
    return values;
  }
  for (const auto& [fqn, tensor] : method.container->CurrentConstants()) {
    if (!buffer_index_.count(fqn)) continue;
    if (DeviceType(tensor) != device_->torch_device_type()) {
      Throw(ErrorKind::kPackage, "mutable buffer '" + fqn + "' of method '" + method.name +
                                     "' is not on the engine's device " + device_->spec().ToString());
    }
    values[fqn] = InitialValue{ReadLayout(tensor), DataPtr(tensor)};
  }
  return values;
}

void Engine::HoldWeights() {
  weights_ = std::make_unique<WeightStore>(*device_);
  bool adopted = false;
  for (Method& method : methods_) {
    Container& container = *method.container;
    if (!method.weights_file && !container.holds_own_constants()) {
      bool any = false;
      for (const ConstantInfo& c : container.constants()) any = any || !c.from_folded;
      if (any) {
        Throw(ErrorKind::kPackage, "method '" + method.name +
                                       "' was compiled without its weights and no weights file "
                                       "came with it");
      }
    }
    // The first container that embeds its weights keeps them: the engine
    // adopts them in place instead of copying (load peak = one copy).
    bool adopt = !method.weights_file && container.holds_own_constants() && !adopted;
    std::unordered_map<std::string, AtenTensorHandle> current;
    if (!method.weights_file) current = container.CurrentConstants();
    for (const ConstantInfo& c : container.constants()) {
      if (c.from_folded || buffer_index_.count(c.fqn)) continue;
      HeldWeight* held = nullptr;
      bool differs = false;
      if (method.weights_file) {
        const WeightEntry* entry = FindEntry(*method.weights_file, c.fqn);
        if (entry == nullptr) {
          Throw(ErrorKind::kPackage, "weights file " + method.weights_file->path +
                                         " has no tensor for constant '" + c.fqn + "' of method '" +
                                         method.name + "'");
        }
        if (entry->layout.dtype != c.dtype) {
          Throw(ErrorKind::kPackage, "weights file " + method.weights_file->path + ": '" + c.fqn +
                                         "' is " + DtypeName(entry->layout.dtype) + " but method '" +
                                         method.name + "' expects " + DtypeName(c.dtype));
        }
        held = weights_->FindFile(*method.weights_file, *entry, &differs);
        if (held == nullptr) {
          if (differs) NoteDifferingWeight(method, c.fqn);
          held = weights_->AddFile(*method.weights_file, *entry);
        }
      } else {
        auto tensor = current.find(c.fqn);
        if (tensor == current.end()) {
          Throw(ErrorKind::kPackage, "method '" + method.name + "' lists constant '" + c.fqn +
                                         "' but holds no tensor for it");
        }
        TensorLayout layout = ReadLayout(tensor->second);
        void* data = DataPtr(tensor->second);
        held = weights_->FindDevice(c.fqn, layout, data, &differs);
        if (held == nullptr) {
          if (differs) NoteDifferingWeight(method, c.fqn);
          held = adopt ? weights_->Adopt(c.fqn, layout, data) : weights_->AddCopy(c.fqn, layout, data);
        }
      }
      held->methods.push_back(method.name);
      method.weight_bindings.emplace_back(held, c.name);
    }
    if (adopt) {
      adopted = true;
      method.keeps_own_constants = true;
    }
    if (method.weights_file && !method.weight_bindings.empty()) {
      container.BindUserManaged(WeightPairs(method, nullptr));
      container.ReclaimBindHandles();
    }
  }
}

void Engine::NoteDifferingWeight(const Method& method, const std::string& fqn) {
  std::vector<std::string> others;
  for (HeldWeight* w : weights_->WithFqn(fqn)) {
    others.insert(others.end(), w->methods.begin(), w->methods.end());
  }
  std::string what = "weight '" + fqn + "' of method '" + method.name +
                     "' differs (layout or content) from the one of method(s) " + JoinNames(others);
  if (options_.strict_weights) {
    Throw(ErrorKind::kPackage, what + "; strict weights refuse to keep two copies");
  }
  load_notes_.push_back(what + ": kept as a separate copy");
}

std::vector<AOTInductorConstantMapEntry> Engine::WeightPairs(
    const Method& method, const std::unordered_set<const HeldWeight*>* only) const {
  std::vector<AOTInductorConstantMapEntry> pairs;
  for (const auto& [held, name] : method.weight_bindings) {
    if (only == nullptr || only->count(held)) pairs.push_back({name.c_str(), held->tensor.get()});
  }
  return pairs;
}

void Engine::FinishWeights() {
  for (Method& method : methods_) {
    Container& container = *method.container;
    if (method.keeps_own_constants || !container.holds_own_constants()) continue;
    // Its weights are shared now: bind everything it reads elsewhere and free
    // its blob. Mutable constants get parking memory until a session binds.
    if (parking_ == nullptr) {
      for (const MutableBuffer& b : buffers_) parking_bytes_ = std::max(parking_bytes_, b.bytes);
      if (parking_bytes_ > 0) parking_ = device_->Allocate(parking_bytes_, nullptr);
      for (const MutableBuffer& b : buffers_) {
        parking_tensors_.push_back(OwnedTensor::FromBlob(
            parking_, b.layout, device_->torch_device_type(), device_->spec().index));
      }
    }
    auto pairs = WeightPairs(method, nullptr);
    for (const auto& [buffer, name] : method.bindings) {
      pairs.push_back({name.c_str(), parking_tensors_[buffer].get()});
    }
    container.ReplaceAllUserManaged(pairs);
  }
  file_initial_.clear();
}

size_t Engine::weight_bytes() const { return weights_ ? weights_->held_bytes() : 0; }

MemoryReport Engine::memory_report() const {
  MemoryReport r;
  r.weights = weight_bytes();
  r.templates = template_bytes_;
  {
    std::lock_guard<std::mutex> lock(sessions_mutex_);
    r.sessions = static_cast<size_t>(device_bytes_);
    r.offloaded = static_cast<size_t>(host_bytes_);
  }
  r.host_spare = HostSpareBytes();
  r.containers = parking_bytes_;
  for (const Method& method : methods_) {
    if (!method.keeps_own_constants || !method.container) continue;
    // Its blob also holds the container's own copy of the mutable state.
    for (const ConstantInfo& c : method.container->constants()) {
      if (!c.from_folded && buffer_index_.count(c.fqn)) r.containers += c.data_size;
    }
  }
  return r;
}

void Engine::SyncRunStreams() {
  for (StreamHandle stream : run_streams_) device_->Synchronize(stream);
}

void Engine::UpdateWeights(const std::vector<WeightUpdate>& updates, bool double_buffer) {
  // Validate everything before writing anything.
  std::vector<HeldWeight*> targets;
  std::set<std::string> seen;
  const int32_t cpu = Shim().device_type_cpu;
  for (const WeightUpdate& u : updates) {
    if (!seen.insert(u.fqn).second) {
      Throw(ErrorKind::kInvalidArgument, "weight '" + u.fqn + "' is given twice");
    }
    auto held = weights_ ? weights_->WithFqn(u.fqn) : std::vector<HeldWeight*>{};
    if (held.empty()) {
      Throw(ErrorKind::kInvalidArgument,
            buffer_index_.count(u.fqn)
                ? "'" + u.fqn + "' is per-session mutable state, not a weight"
                : "'" + u.fqn + "' is not a weight of this engine (no method reads it as a "
                  "constant; the compiler may have folded it into the code)");
    }
    if (held.size() > 1) {
      Throw(ErrorKind::kInvalidArgument, "weight '" + u.fqn + "' is held in " +
                                             std::to_string(held.size()) +
                                             " variants (methods disagree on it); cannot update "
                                             "it by name");
    }
    TensorLayout layout = ReadLayout(u.source);
    const TensorLayout& want = held[0]->layout;
    if (layout.dtype != want.dtype) {
      Throw(ErrorKind::kTypeMismatch, "weight '" + u.fqn + "' is " + DtypeName(want.dtype) +
                                          ", got " + DtypeName(layout.dtype));
    }
    if (layout.sizes != want.sizes) {
      Throw(ErrorKind::kInvalidArgument, "weight '" + u.fqn + "' is " + want.ToString() +
                                             ", got shape " + layout.ToString());
    }
    if (layout.strides != want.strides) {
      Throw(ErrorKind::kInvalidArgument, "weight '" + u.fqn + "' has strides of " +
                                             want.ToString() + ", got " + layout.ToString() +
                                             " (pass a tensor with the same strides, e.g. "
                                             ".contiguous())");
    }
    if (DeviceType(u.source) != cpu) {
      Throw(ErrorKind::kInvalidArgument, "weight '" + u.fqn + "': the new value must be a CPU "
                                             "tensor (pinned or pageable)");
    }
    targets.push_back(held[0]);
  }
  if (targets.empty()) return;
  if (!double_buffer) {
    std::lock_guard<std::mutex> lock(run_mutex_);
    if (methods_.empty() || !methods_[0].container) {
      Throw(ErrorKind::kSessionClosed, "the engine is closed");
    }
    SyncRunStreams();  // runs in flight finish with the old weights
    for (size_t i = 0; i < targets.size(); ++i) {
      device_->Copy(targets[i]->data, DataPtr(updates[i].source), targets[i]->bytes, nullptr);
    }
    device_->Synchronize(nullptr);
    return;
  }
  // Fill new memory while runs go on.
  std::vector<void*> fresh;
  try {
    for (size_t i = 0; i < targets.size(); ++i) {
      fresh.push_back(device_->Allocate(targets[i]->bytes, nullptr));
      device_->Copy(fresh.back(), DataPtr(updates[i].source), targets[i]->bytes, nullptr);
    }
    device_->Synchronize(nullptr);
  } catch (...) {
    for (void* p : fresh) device_->Free(p, nullptr);
    throw;
  }
  std::vector<void*> old;
  std::vector<StreamHandle> streams;
  {
    std::lock_guard<std::mutex> lock(run_mutex_);
    if (methods_.empty() || !methods_[0].container) {
      for (void* p : fresh) device_->Free(p, nullptr);
      Throw(ErrorKind::kSessionClosed, "the engine is closed");
    }
    std::unordered_set<const HeldWeight*> changed(targets.begin(), targets.end());
    for (size_t i = 0; i < targets.size(); ++i) {
      old.push_back(weights_->Replace(*targets[i], fresh[i]));
    }
    // Every method switches before the next run: none sees a mix.
    for (Method& method : methods_) {
      auto pairs = WeightPairs(method, &changed);
      if (pairs.empty()) continue;
      method.container->BindUserManaged(pairs);
      method.container->ReclaimBindHandles();
    }
    streams = run_streams_;
  }
  // The old memory is free once the runs queued before the switch are done.
  for (StreamHandle stream : streams) device_->Synchronize(stream);
  for (void* p : old) {
    if (p != nullptr) device_->Free(p, nullptr);
  }
}

}  // namespace aoti_sessions
