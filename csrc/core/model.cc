// Loading a model: its methods, the selection of mutable state, its
// descriptors, the block layout and the templates of the initial state.
#include "model.h"

#include <fnmatch.h>

#include <algorithm>
#include <set>

#include "errors.h"
#include "util.h"

namespace aoti_sessions {
namespace {

constexpr size_t kBlockAlignment = 256;

}  // namespace

size_t PoolLayout::PagesFor(int64_t positions) const {
  if (!has_pages() || positions <= 0) return 0;
  return static_cast<size_t>((positions + page_size - 1) / page_size);
}

std::vector<size_t> PoolLayout::PackedOffsets(size_t pages) const {
  std::vector<size_t> offsets;
  size_t offset = 0;
  for (const PooledTensor& t : tensors) {
    offsets.push_back(offset);
    offset += (t.kind == PoolKind::kPages ? pages : 1) * t.unit_bytes;
  }
  return offsets;
}

TensorLayout PoolLayout::SessionLayout(size_t tensor, size_t pages) const {
  const PooledTensor& t = tensors[tensor];
  TensorLayout layout;
  layout.dtype = t.unit.dtype;
  layout.sizes = {t.kind == PoolKind::kPages ? static_cast<int64_t>(pages) : 1};
  layout.sizes.insert(layout.sizes.end(), t.unit.sizes.begin(), t.unit.sizes.end());
  layout.strides = {t.unit.numel()};
  layout.strides.insert(layout.strides.end(), t.unit.strides.begin(), t.unit.strides.end());
  return layout;
}

std::vector<size_t> PoolLayout::Add(const std::string& method, const PoolSource& source,
                                    const std::vector<InputSpec>& inputs) {
  // The first method laid out finds no tensor here (every pool has one: PoolSource::Validate).
  if (tensors.empty()) {
    from = method;
    page_size = source.page_size;
  }
  auto disagree = [&](const std::string& what) {
    Throw(ErrorKind::kPackage, "method '" + method + "' and method '" + from +
                                   "' disagree on the pooled state: " + what);
  };
  if (source.page_table) {
    const int64_t static_width = inputs[*source.page_table].sizes[1];
    const int64_t width = static_width > 0 ? static_width : source.max_pages;
    if (max_pages != 0 && max_pages != width) {
      disagree("page tables of " + std::to_string(width) + " and " + std::to_string(max_pages) +
               " pages");
    }
    if (page_size != source.page_size) {
      disagree("pages of " + std::to_string(source.page_size) + " and " +
               std::to_string(page_size) + " positions");
    }
    max_pages = width;
  }
  max_rows = std::max(max_rows, source.max_rows);
  std::vector<size_t> indices;
  for (const PooledInput& t : source.tensors) {
    const InputSpec& spec = inputs[t.input];
    if (!spec.strides.empty()) {
      Throw(ErrorKind::kPackage,
            "method '" + method + "': pooled tensor '" + t.name + "' must be contiguous");
    }
    TensorLayout unit;
    unit.dtype = spec.dtype;
    unit.sizes.assign(spec.sizes.begin() + 1, spec.sizes.end());
    unit.strides = ContiguousStrides(unit.sizes);
    auto held = std::find_if(tensors.begin(), tensors.end(),
                             [&](const PooledTensor& p) { return p.name == t.name; });
    if (held == tensors.end()) {
      PooledTensor tensor{t.name, t.kind, unit, unit.span_bytes()};
      (t.kind == PoolKind::kPages ? page_bytes : slot_bytes) += tensor.unit_bytes;
      tensors.push_back(std::move(tensor));
      held = tensors.end() - 1;
    } else if (held->unit != unit || held->kind != t.kind) {
      disagree("'" + t.name + "' is " + held->unit.ToString() + " in one and " + unit.ToString() +
               " in the other, or pages in one and slots in the other");
    }
    indices.push_back(static_cast<size_t>(held - tensors.begin()));
  }
  return indices;
}

LoadedModel Model::Load(const std::vector<MethodSource>& sources, const EngineOptions& options) {
  std::shared_ptr<Model> model(new Model());
  std::vector<std::unique_ptr<Container>> containers = model->OpenMethods(sources, options);
  model->LayOutPool();
  model->SelectMutable(containers, options);
  model->HoldWeights(containers, options.strict_weights);
  model->CaptureTemplates(containers);
  model->FinishWeights(containers);
  const int64_t lanes = options.lanes.value_or(EngineOptions::kDefaultLanes);
  auto all = model->MakeLanes(std::move(containers), static_cast<size_t>(lanes),
                              options.reclaim_bind_handles);
  return {std::move(model), std::move(all)};
}

Model::~Model() {
  weights_.reset();
  parking_tensors_.clear();
  try {
    if (template_block_ != nullptr) device_->Free(template_block_, template_stream_.last());
    if (parking_ != nullptr) device_->Free(parking_, nullptr);
  } catch (...) {
    // A broken device runtime (say a sticky CUDA error) must not abort teardown.
  }
}

std::vector<std::unique_ptr<Container>> Model::OpenMethods(
    const std::vector<MethodSource>& sources, const EngineOptions& options) {
  device_ = OpenDevice(DeviceSpec::Parse(options.device));
  const DeviceSpec& spec = device_->spec();
  std::vector<std::unique_ptr<Container>> containers;
  std::unordered_map<std::string, std::shared_ptr<ModelLibrary>> libraries;
  for (const MethodSource& source : sources) {
    auto& library = libraries[source.library_path];
    if (!library) library = ModelLibrary::Open(source.library_path);
    bool wants_cuda = spec.kind == DeviceKind::kCuda;
    if (library->targets_cuda() != wants_cuda) {
      Throw(ErrorKind::kPackage, "method '" + source.name + "' (" + source.library_path +
                                     ") was compiled for " +
                                     (library->targets_cuda() ? "cuda" : "cpu") +
                                     ", but the engine's device is " + spec.ToString());
    }
    auto container = std::make_unique<Container>(library, spec, source.cubin_dir,
                                                 options.reclaim_bind_handles, source.proxy);
    if (source.inputs && source.inputs->size() != container->num_inputs()) {
      Throw(ErrorKind::kPackage, "method '" + source.name + "' declares " +
                                     std::to_string(source.inputs->size()) +
                                     " input specs, but its model takes " +
                                     std::to_string(container->num_inputs()));
    }
    Method method;
    method.name = source.name;
    method.library_path = source.library_path;
    method.cubin_dir = source.cubin_dir;
    method.weights_file = source.weights;
    method.inputs = source.inputs;
    method.proxy = source.proxy;
    method.call_spec = {container->in_spec(), container->out_spec()};
    method.num_inputs = container->num_inputs();
    method.pool = source.pool;
    methods_.push_back(std::move(method));
    containers.push_back(std::move(container));
  }
  return containers;
}

void Model::SelectMutable(const std::vector<std::unique_ptr<Container>>& containers,
                          const EngineOptions& options) {
  // Every non-folded constant FQN, in order of first appearance.
  std::vector<std::string> fqns;
  std::set<std::string> seen;
  std::set<std::string> buffer_typed;
  for (const auto& container : containers) {
    for (const ConstantInfo& c : container->constants()) {
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
  if (pool_ && !buffers_.empty()) {
    std::vector<std::string> names;
    for (const MutableBuffer& b : buffers_) names.push_back(b.fqn);
    Throw(ErrorKind::kPackage, "this model keeps pooled state, so all of its mutable state must be "
                               "pooled, but these buffers would be per-session constants: " +
                                   JoinNames(names));
  }
}

void Model::LayOutPool() {
  for (Method& method : methods_) {
    std::set<size_t> engine_filled;  // inputs the engine fills: pooled tensors, page table, ...
    if (method.pool) {
      const PoolSource& source = *method.pool;
      if (!pool_) pool_.emplace();
      method.pool_tensors = pool_->Add(method.name, source, *method.inputs);
      for (const PooledInput& t : source.tensors) engine_filled.insert(t.input);
      for (std::optional<size_t> filled : {source.page_table, source.positions, source.slot_ids}) {
        if (filled) engine_filled.insert(*filled);
      }
    }
    for (size_t i = 0; i < method.num_inputs; ++i) {
      if (!engine_filled.count(i)) method.caller_inputs.push_back(i);
    }
  }
}

void Model::CaptureTemplates(const std::vector<std::unique_ptr<Container>>& containers) {
  // Where each buffer's initial value lives (the first method that has it).
  std::vector<const void*> initial(buffers_.size(), nullptr);
  std::vector<std::string> first_method(buffers_.size());
  for (size_t m = 0; m < methods_.size(); ++m) {
    Method& method = methods_[m];
    auto values = InitialValues(method, *containers[m]);
    for (const ConstantInfo& c : containers[m]->constants()) {
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
      method.state_bindings.emplace_back(index->second, c.name);
    }
  }
  LayOutBlock(initial);
}

void Model::LayOutBlock(const std::vector<const void*>& initial) {
  StreamHandle stream = nullptr;
  // Buffers with a non-zero initial value first, so that initialising a block
  // is one copy of that prefix plus one memset.
  for (size_t i = 0; i < buffers_.size(); ++i) {
    buffers_[i].zero_initial = device_->IsZero(initial[i], buffers_[i].bytes, stream);
  }
  size_t offset = 0;
  for (bool zero : {false, true}) {
    for (MutableBuffer& buffer : buffers_) {
      if (buffer.zero_initial != zero) continue;
      buffer.offset = offset;
      offset += AlignUp(buffer.bytes, kBlockAlignment);
    }
    if (!zero) nonzero_prefix_bytes_ = offset;
  }
  block_bytes_ = offset;
  if (nonzero_prefix_bytes_ == 0) return;
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

std::vector<std::string> Model::method_names() const {
  std::vector<std::string> names;
  for (const Method& m : methods_) names.push_back(m.name);
  return names;
}

size_t Model::method_index(const std::string& name) const {
  for (size_t i = 0; i < methods_.size(); ++i) {
    if (methods_[i].name == name) return i;
  }
  Throw(ErrorKind::kInvalidArgument,
        "unknown method '" + name + "'; this engine has: " + JoinNames(method_names()));
}

const Method& Model::method(size_t index) const {
  if (index >= methods_.size()) {
    Throw(ErrorKind::kInvalidArgument, "method index " + std::to_string(index) +
                                           " out of range (" + std::to_string(methods_.size()) +
                                           " methods)");
  }
  return methods_[index];
}

size_t Model::buffer_index(const std::string& fqn) const {
  auto it = buffer_index_.find(fqn);
  if (it == buffer_index_.end()) {
    Throw(ErrorKind::kInvalidArgument, "'" + fqn + "' is not a mutable buffer of this engine");
  }
  return it->second;
}

void Model::InitializeBlock(void* block, StreamHandle stream) const {
  auto* base = static_cast<char*>(block);
  if (nonzero_prefix_bytes_ > 0) {
    template_stream_.Use(*device_, stream);
    device_->Copy(base, template_block_, nonzero_prefix_bytes_, stream);
  }
  if (block_bytes_ > nonzero_prefix_bytes_) {
    device_->Zero(base + nonzero_prefix_bytes_, block_bytes_ - nonzero_prefix_bytes_, stream);
  }
}

std::vector<OwnedTensor> Model::AliasTensors(void* block) const {
  auto* base = static_cast<char*>(block);
  std::vector<OwnedTensor> tensors;
  for (const MutableBuffer& buffer : buffers_) {
    tensors.push_back(OwnedTensor::FromBlob(base + buffer.offset, buffer.layout,
                                            device_->torch_device_type(), device_->spec().index));
  }
  return tensors;
}

}  // namespace aoti_sessions
