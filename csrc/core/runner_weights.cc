// Weight updates: new values for held weights, in place (runs wait) or double
// buffered (runs go on; every lane of every method switches at once), under
// the weights lock held exclusively.
#include <set>

#include "errors.h"
#include "runner.h"

namespace aoti_sessions {

void Runner::SyncRunStreams() {
  std::vector<StreamHandle> streams;
  {
    MutexLock lock(lanes_mutex_);
    streams = run_streams_;
  }
  for (StreamHandle stream : streams) device_.Synchronize(stream);
}

std::vector<HeldWeight*> Runner::ValidateUpdates(const std::vector<WeightUpdate>& updates) const {
  std::vector<HeldWeight*> targets;
  std::set<std::string> seen;
  const int32_t cpu = Shim().device_type_cpu;
  for (const WeightUpdate& u : updates) {
    if (!seen.insert(u.fqn).second) {
      Throw(ErrorKind::kInvalidArgument, "weight '" + u.fqn + "' is given twice");
    }
    std::vector<HeldWeight*> held = model_->weights().WithFqn(u.fqn);
    if (held.empty()) {
      Throw(ErrorKind::kInvalidArgument,
            model_->is_mutable(u.fqn)
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
    TensorLayout layout = ReadLayout(u.source, "weight '" + u.fqn + "'");
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
  return targets;
}

void Runner::UpdateWeights(const std::vector<WeightUpdate>& updates, bool double_buffer) {
  // Validate everything before writing anything.
  const std::vector<HeldWeight*> targets = ValidateUpdates(updates);
  if (targets.empty()) return;
  if (!double_buffer) {
    WriterLock lock(weights_mutex_);
    CheckOpenLocked();
    SyncRunStreams();  // runs in flight finish with the old weights
    for (size_t i = 0; i < targets.size(); ++i) {
      device_.Copy(targets[i]->data, DataPtr(updates[i].source), targets[i]->bytes, nullptr);
    }
    device_.Synchronize(nullptr);
    return;
  }
  // Fill new memory while runs go on.
  std::vector<void*> fresh;
  auto free_fresh = [&] {
    for (void* p : fresh) device_.Free(p, nullptr);
  };
  try {
    for (size_t i = 0; i < targets.size(); ++i) {
      fresh.push_back(device_.Allocate(targets[i]->bytes, nullptr));
      device_.Copy(fresh.back(), DataPtr(updates[i].source), targets[i]->bytes, nullptr);
    }
    device_.Synchronize(nullptr);
  } catch (...) {
    free_fresh();
    throw;
  }
  std::vector<void*> old;
  {
    WriterLock lock(weights_mutex_);
    try {
      CheckOpenLocked();
      old = SwitchWeightsLocked(targets, fresh);
    } catch (...) {
      free_fresh();
      throw;
    }
    ++weights_epoch_;  // graphs hold the old addresses: recapture
  }
  // The old memory is free once the runs queued before the switch are done.
  SyncRunStreams();
  for (void* p : old) {
    if (p != nullptr) device_.Free(p, nullptr);
  }
}

std::vector<void*> Runner::SwitchWeightsLocked(const std::vector<HeldWeight*>& targets,
                                                  const std::vector<void*>& fresh) {
  WeightStore& store = model_->weights();
  std::vector<OwnedTensor> tensors;
  WeightTensors to_new, to_old;
  for (size_t i = 0; i < targets.size(); ++i) {
    tensors.push_back(store.Alias(*targets[i], fresh[i]));
    to_new[targets[i]] = tensors.back().get();
    to_old[targets[i]] = targets[i]->tensor.get();
  }
  // Every method switches before the next run: none sees a mix. If one
  // cannot, those switched already go back to the old weights.
  size_t m = 0;
  try {
    for (; m < lanes_.size(); ++m) BindWeightsLocked(m, to_new);
  } catch (...) {
    for (size_t back = 0; back <= m && back < lanes_.size(); ++back) {
      try {
        BindWeightsLocked(back, to_old);
      } catch (...) {
        // Nothing better to do: the error being thrown reports the failure.
      }
    }
    throw;
  }
  std::vector<void*> old;
  for (size_t i = 0; i < targets.size(); ++i) {
    old.push_back(store.Replace(*targets[i], fresh[i], std::move(tensors[i])));
  }
  for (auto& method_lanes : lanes_) {
    for (Lane& lane : method_lanes) {
      try {
        lane.container->ReclaimBindHandles(ErrorKind::kInternal);
      } catch (...) {
        // A failed extract only means a few handles stay leaked.
      }
    }
  }
  return old;
}

void Runner::BindWeightsLocked(size_t method, const WeightTensors& tensors) {
  auto pairs = WeightPairs(model_->methods()[method], &tensors);
  if (pairs.empty()) return;
  for (Lane& lane : lanes_[method]) lane.container->BindUserManaged(pairs, ErrorKind::kRun);
}

}  // namespace aoti_sessions
