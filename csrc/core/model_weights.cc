// Weights held once at load: every method's weight constants bound to one held
// copy each (read from the package's weights file, adopted in place from the
// first container that embeds them, or copied), and the initial values of the
// mutable state read from wherever the weights came from.
#include <algorithm>

#include "errors.h"
#include "model.h"
#include "util.h"

namespace aoti_sessions {
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

std::vector<AOTInductorConstantMapEntry> WeightPairs(const Method& method,
                                                     const WeightTensors* only) {
  std::vector<AOTInductorConstantMapEntry> pairs;
  for (const auto& [held, name] : method.weight_bindings) {
    if (only == nullptr) {
      pairs.push_back({name.c_str(), held->tensor.get()});
    } else if (auto it = only->find(held); it != only->end()) {
      pairs.push_back({name.c_str(), it->second});
    }
  }
  return pairs;
}

std::unordered_map<std::string, Model::InitialValue> Model::InitialValues(const Method& method,
                                                                          Container& container) {
  std::unordered_map<std::string, InitialValue> values;
  if (method.weights_file) {
    for (const ConstantInfo& c : container.constants()) {
      if (c.from_folded || !is_mutable(c.fqn)) continue;
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
  for (const auto& [fqn, tensor] : container.CurrentConstants(ErrorKind::kPackage)) {
    if (!is_mutable(fqn)) continue;
    if (DeviceType(tensor) != device_->torch_device_type()) {
      Throw(ErrorKind::kPackage, "mutable buffer '" + fqn + "' of method '" + method.name +
                                     "' is not on the engine's device " + device_->spec().ToString());
    }
    values[fqn] = InitialValue{ReadLayout(tensor), DataPtr(tensor)};
  }
  return values;
}

void Model::HoldWeights(const std::vector<std::unique_ptr<Container>>& containers, bool strict) {
  weights_ = std::make_unique<WeightStore>(*device_);
  bool adopted = false;
  for (size_t m = 0; m < methods_.size(); ++m) {
    Method& method = methods_[m];
    Container& container = *containers[m];
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
    if (!method.weights_file) current = container.CurrentConstants(ErrorKind::kPackage);
    for (const ConstantInfo& c : container.constants()) {
      if (c.from_folded || is_mutable(c.fqn)) continue;
      HeldWeight* held = method.weights_file ? HoldFromFile(method, c, strict)
                                             : HoldEmbedded(method, c, current, adopt, strict);
      held->methods.push_back(method.name);
      method.weight_bindings.emplace_back(held, c.name);
    }
    if (adopt) {
      adopted = true;
      method.keeps_own_constants = true;
    }
    if (method.weights_file && !method.weight_bindings.empty()) {
      container.BindUserManaged(WeightPairs(method), ErrorKind::kPackage);
      container.ReclaimBindHandles(ErrorKind::kPackage);
    }
  }
}

HeldWeight* Model::HoldFromFile(const Method& method, const ConstantInfo& c, bool strict) {
  const WeightsFile& file = *method.weights_file;
  const WeightEntry* entry = FindEntry(file, c.fqn);
  if (entry == nullptr) {
    Throw(ErrorKind::kPackage, "weights file " + file.path + " has no tensor for constant '" +
                                   c.fqn + "' of method '" + method.name + "'");
  }
  if (entry->layout.dtype != c.dtype) {
    Throw(ErrorKind::kPackage, "weights file " + file.path + ": '" + c.fqn + "' is " +
                                   DtypeName(entry->layout.dtype) + " but method '" + method.name +
                                   "' expects " + DtypeName(c.dtype));
  }
  bool differs = false;
  if (HeldWeight* held = weights_->FindFile(file, *entry, &differs)) return held;
  if (differs) NoteDifferingWeight(method, c.fqn, strict);
  return weights_->AddFile(file, *entry);
}

HeldWeight* Model::HoldEmbedded(const Method& method, const ConstantInfo& c,
                                const std::unordered_map<std::string, AtenTensorHandle>& current,
                                bool adopt, bool strict) {
  auto tensor = current.find(c.fqn);
  if (tensor == current.end()) {
    Throw(ErrorKind::kPackage, "method '" + method.name + "' lists constant '" + c.fqn +
                                   "' but holds no tensor for it");
  }
  TensorLayout layout = ReadLayout(tensor->second);
  void* data = DataPtr(tensor->second);
  bool differs = false;
  if (HeldWeight* held = weights_->FindDevice(c.fqn, layout, data, &differs)) return held;
  if (differs) NoteDifferingWeight(method, c.fqn, strict);
  return adopt ? weights_->Adopt(c.fqn, layout, data) : weights_->AddCopy(c.fqn, layout, data);
}

void Model::NoteDifferingWeight(const Method& method, const std::string& fqn, bool strict) {
  std::vector<std::string> others;
  for (HeldWeight* w : weights_->WithFqn(fqn)) {
    others.insert(others.end(), w->methods.begin(), w->methods.end());
  }
  std::string what = "weight '" + fqn + "' of method '" + method.name +
                     "' differs (layout or content) from the one of method(s) " + JoinNames(others);
  if (strict) Throw(ErrorKind::kPackage, what + "; strict weights refuse to keep two copies");
  load_notes_.push_back(what + ": kept as a separate copy");
}

void Model::FinishWeights(const std::vector<std::unique_ptr<Container>>& containers) {
  for (size_t m = 0; m < methods_.size(); ++m) {
    const Method& method = methods_[m];
    Container& container = *containers[m];
    if (method.keeps_own_constants) {
      // Its blob also holds the container's own copy of the mutable state.
      for (const ConstantInfo& c : container.constants()) {
        if (!c.from_folded && is_mutable(c.fqn)) container_state_bytes_ += c.data_size;
      }
      continue;
    }
    if (!container.holds_own_constants()) continue;
    // Its weights are shared now: bind everything it reads elsewhere and free
    // its blob.
    ShareWeights(m, container);
  }
  file_initial_.clear();
}

void Model::EnsureParking() {
  if (parking_ != nullptr || !parking_tensors_.empty()) return;
  for (const MutableBuffer& b : buffers_) parking_bytes_ = std::max(parking_bytes_, b.bytes);
  if (parking_bytes_ > 0) parking_ = device_->Allocate(parking_bytes_, nullptr);
  for (const MutableBuffer& b : buffers_) {
    parking_tensors_.push_back(OwnedTensor::FromBlob(parking_, b.layout,
                                                     device_->torch_device_type(),
                                                     device_->spec().index));
  }
}

void Model::ShareWeights(size_t m, Container& container) {
  const Method& method = methods_[m];
  if (!container.holds_own_constants()) {
    // Compiled without weights: bind them; the state binds with a session.
    if (method.weight_bindings.empty()) return;
    container.BindUserManaged(WeightPairs(method), ErrorKind::kPackage);
    container.ReclaimBindHandles(ErrorKind::kPackage);
    return;
  }
  // Mutable constants get parking memory until a session binds (never read:
  // every run binds a session first).
  EnsureParking();
  auto pairs = WeightPairs(method);
  for (const auto& [buffer, name] : method.state_bindings) {
    pairs.push_back({name.c_str(), parking_tensors_[buffer].get()});
  }
  container.ReplaceAllUserManaged(pairs, ErrorKind::kPackage);
}

std::vector<Lanes> Model::MakeLanes(std::vector<std::unique_ptr<Container>> first, size_t count,
                                    bool reclaim_bind_handles) {
  std::vector<Lanes> lanes(first.size());
  for (size_t m = 0; m < first.size(); ++m) {
    std::shared_ptr<ModelLibrary> library = first[m]->shared_library();
    lanes[m].push_back(std::move(first[m]));
    for (size_t i = 1; i < count; ++i) {
      // A new container copies the library's embedded weights into a blob of
      // its own; sharing the held weights frees it again.
      auto lane = std::make_unique<Container>(library, device_->spec(), methods_[m].cubin_dir,
                                              reclaim_bind_handles, methods_[m].proxy);
      ShareWeights(m, *lane);
      lanes[m].push_back(std::move(lane));
    }
  }
  return lanes;
}

std::vector<WeightInfo> Model::weight_infos() const {
  std::vector<WeightInfo> out;
  for (const auto& w : weights_->all()) out.push_back({w->fqn, w->layout, w->bytes, w->methods});
  return out;
}

}  // namespace aoti_sessions
