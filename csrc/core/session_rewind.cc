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
  if (!parts_->pool) {
    Throw(ErrorKind::kInvalidArgument, "truncate needs pooled state; this engine has none");
  }
  StatePool& pool = *parts_->pool;
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
  if (pool.layout().has_slots() && length < share.length) {
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
  parts_->residency->Restore(*state_, stream);
  state_->Touch();
  state_->Use(parts_->model->device(), stream);
  if (rewound >= 0) pool.CopySlot(share.slot, rewound, stream);
  parts_->residency->DropCheckpoints(*state_, kept, checkpoints.size(), stream);
  share.length = length;
  TrimPages(*parts_, *state_, stream);
}

void Session::Checkpoint(int64_t keep, StreamHandle stream) {
  OpLock lock(*this);
  state_->CheckOpen();
  if (!parts_->pool || !parts_->pool->layout().has_slots()) {
    Throw(ErrorKind::kInvalidArgument,
          "checkpoint needs slot state (a conv or recurrent state); this engine has none");
  }
  if (keep < 1) {
    Throw(ErrorKind::kInvalidArgument, "checkpoint: keep must be at least 1, got " +
                                           std::to_string(keep));
  }
  StatePool& pool = *parts_->pool;
  parts_->residency->Restore(*state_, stream);
  state_->Touch();
  state_->Use(parts_->model->device(), stream);
  PoolShare& share = state_->share();
  std::vector<SlotCheckpoint>& checkpoints = share.checkpoints;
  // The slot changes only with the length (a run feeds positions; a reset
  // or a written state drops the checkpoints): one at this length is current.
  if (!checkpoints.empty() && checkpoints.back().length == share.length) return;
  const auto most = static_cast<size_t>(keep);
  if (checkpoints.size() >= most) {
    parts_->residency->DropCheckpoints(*state_, 0, checkpoints.size() - most + 1, stream);
  }
  const auto bytes = static_cast<int64_t>(pool.layout().slot_bytes);
  parts_->residency->Reserve({state_.get()}, bytes, stream);
  int32_t slot = -1;
  try {
    slot = pool.TakeSlot(stream);
  } catch (...) {
    parts_->residency->Shrink(bytes);
    throw;
  }
  pool.CopySlot(slot, share.slot, stream);
  checkpoints.push_back({share.length, slot});
  state_->set_bytes(state_->bytes() + bytes);
}

std::vector<int64_t> Session::Checkpoints() {
  OpLock lock(*this);
  std::vector<int64_t> lengths;
  for (const SlotCheckpoint& c : state_->share().checkpoints) lengths.push_back(c.length);
  return lengths;
}

void Session::TrimPages(const EngineParts& parts, SessionState& state, StreamHandle stream) {
  PoolShare& share = state.share();
  const size_t keep = parts.pool->layout().PagesFor(share.length);
  if (keep >= share.pages.size()) return;
  std::vector<int32_t> dropped(share.pages.begin() + static_cast<std::ptrdiff_t>(keep),
                               share.pages.end());
  share.pages.resize(keep);
  parts.pool->ReleasePages(dropped, stream);
  const int64_t bytes = parts.pool->ShareBytes(share, keep);
  parts.residency->Shrink(state.bytes() - bytes);
  state.set_bytes(bytes);
}

}  // namespace aoti_sessions
