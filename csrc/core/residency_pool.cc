// The residency's side of pooled state (docs/batching.md): a session's
// units packed to a host block and back (offload, restore), and the device
// room its slot checkpoints hold.
#include "residency.h"

namespace aoti_sessions {

void Residency::DropCheckpoints(SessionState& state, size_t first, size_t last,
                                StreamHandle stream) {
  const int64_t freed = pool_->ReleaseCheckpoints(state.share(), first, last, stream);
  if (freed == 0) return;
  state.set_bytes(state.bytes() - freed);
  Shrink(freed);
}

void* Residency::PackToHost(SessionState& state, StreamHandle stream) {
  PoolShare& share = state.share();
  void* host = nullptr;
  const size_t bytes = pool_->layout().PackedBytes(share.pages.size());
  if (bytes > 0) host = device_.AllocateHost(bytes);
  try {
    if (bytes > 0) {
      pool_->Pack(share, host, stream);
      device_.Synchronize(stream);
    }
  } catch (...) {
    device_.FreeHost(host);
    throw;
  }
  // The copy is done: the units go back (after this stream's work, which
  // includes the copy).
  pool_->Release(share, stream);
  return host;
}

void Residency::UnpackFromHost(SessionState& state, StreamHandle stream) {
  PoolShare& share = state.share();
  const StatePool& pool = *pool_;
  PoolShare taken;
  try {
    taken.pages = pool_->TakePages(pool.layout().PagesFor(share.length), /*zero=*/false, stream);
    if (pool.layout().has_slots()) taken.slot = pool_->TakeSlot(stream);
    if (pool.layout().PackedBytes(taken.pages.size()) > 0) {
      pool_->Unpack(state.memory(), taken, stream);
      device_.Synchronize(stream);  // the host copy is freed right after
    }
  } catch (...) {
    pool_->Release(taken, stream);
    throw;
  }
  share.pages = std::move(taken.pages);
  share.slot = taken.slot;
}

}  // namespace aoti_sessions
