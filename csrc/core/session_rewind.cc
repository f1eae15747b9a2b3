// Rewinding a session's pooled state: truncation (pages past the new length
// released) and the slot checkpoints a session with slot state rewinds to.
// Each runs under the session's lock.
#include <algorithm>

#include "errors.h"
#include "session.h"
#include "util.h"

namespace aoti_sessions {

void Session::Truncate(int64_t length, StreamHandle stream) {
  OpLock lock(*this);
  state_->CheckOpen();
  PoolStore& store = parts_->store->Pooled("truncate needs pooled state; this engine has none");
  PoolShare& share = state_->share();
  if (length < 0 || length > share.length) {
    Throw(ErrorKind::kInvalidArgument, "cannot truncate session " + std::to_string(id()) +
                                           " to " + std::to_string(length) +
                                           " positions: it holds " +
                                           std::to_string(share.length));
  }
  // A slot holds state that every position so far went into (a conv or
  // recurrent state): it goes back only to a copy kept at that length.
  std::vector<SlotCheckpoint>& checkpoints = share.checkpoints;
  size_t kept = checkpoints.size();  // the checkpoints that stay: those at most `length`
  int32_t rewound = -1;              // the checkpoint slot the session's slot goes back to
  if (store.layout().has_slots() && length < share.length) {
    const auto at = std::find_if(checkpoints.begin(), checkpoints.end(),
                                 [&](const SlotCheckpoint& c) { return c.length == length; });
    if (at == checkpoints.end()) {
      std::vector<std::string> lengths;
      for (const SlotCheckpoint& c : checkpoints) lengths.push_back(std::to_string(c.length));
      Throw(ErrorKind::kInvalidArgument,
            "cannot truncate session " + std::to_string(id()) + " to " + std::to_string(length) +
                " of its " + std::to_string(share.length) +
                " positions: its slot state (recurrent) cannot rewind but to a checkpoint (" +
                (lengths.empty() ? std::string("it has none") : "it has them at " + JoinNames(lengths)) +
                "); reset it and feed the positions again");
    }
    rewound = at->slot;
    kept = static_cast<size_t>(at - checkpoints.begin()) + 1;
  }
  // Restored first: the host copy's layout follows its page count (an
  // offloaded session has no checkpoints, so it never rewinds a slot).
  Prepare(stream);
  if (rewound >= 0) store.pool().CopySlot(share.slot, rewound, stream);
  PoolLease lease(store, *parts_->residency);
  lease.DropCheckpoints(*state_, kept, checkpoints.size(), stream);
  share.length = length;
  lease.Trim(*state_, stream);
}

void Session::Checkpoint(int64_t keep, StreamHandle stream) {
  OpLock lock(*this);
  state_->CheckOpen();
  const std::string refusal =
      "checkpoint needs slot state (a conv or recurrent state); this engine has none";
  PoolStore& store = parts_->store->Pooled(refusal);
  if (!store.layout().has_slots()) Throw(ErrorKind::kInvalidArgument, refusal);
  if (keep < 1) {
    Throw(ErrorKind::kInvalidArgument, "checkpoint: keep must be at least 1, got " +
                                           std::to_string(keep));
  }
  Prepare(stream);
  PoolShare& share = state_->share();
  std::vector<SlotCheckpoint>& checkpoints = share.checkpoints;
  // The slot changes only with the length (a run feeds positions; a reset
  // or a written state drops the checkpoints): one at this length is current.
  if (!checkpoints.empty() && checkpoints.back().length == share.length) return;
  const auto most = static_cast<size_t>(keep);
  if (checkpoints.size() >= most) {
    PoolLease(store, *parts_->residency)
        .DropCheckpoints(*state_, 0, checkpoints.size() - most + 1, stream);
  }
  PoolLease lease(store, *parts_->residency, {state_.get()},
                  static_cast<int64_t>(store.layout().slot_bytes), stream);
  lease.Checkpoint(*state_, stream);
}

std::vector<int64_t> Session::Checkpoints() {
  OpLock lock(*this);
  std::vector<int64_t> lengths;
  for (const SlotCheckpoint& c : state_->share().checkpoints) lengths.push_back(c.length);
  return lengths;
}

}  // namespace aoti_sessions
