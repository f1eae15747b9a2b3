// The pool store: sessions' state as shares of the paged pool, and the
// lease that keeps a resident share's device room in step with its units.
#include "pool_store.h"

#include <algorithm>

namespace aoti_sessions {

PoolStore::PoolStore(std::shared_ptr<Model> model, std::optional<int64_t> max_bytes)
    : model_(std::move(model)),
      device_(model_->device()),
      pool_(model_->device(), *model_->pool(), max_bytes) {}

int64_t PoolStore::Growth(const SessionState& state, int64_t count) const {
  const PoolShare& share = state.share();
  return pool_.ShareBytes(share, layout().PagesFor(share.length + count)) - state.bytes();
}

// ---------------------------------------------------------------- a session's making

StateStore::Source PoolStore::From(const SessionState& state) const {
  const PoolShare& share = state.share();
  Source source;
  source.initial = false;
  source.length = share.length;
  source.pages = layout().PagesFor(share.length);
  if (state.resident()) {
    source.share = &share;  // its pages are shared, copied only when one of the two writes them
  } else {
    source.memory = state.memory();
    source.on_host = true;  // the host copy may move once unlocked
  }
  return source;
}

int64_t PoolStore::BytesOf(const Source& source) const { return pool_.SessionBytes(source.pages); }

void PoolStore::Fill(SessionState& made, const Source& source, StreamHandle stream) {
  PoolShare& share = made.share();
  if (source.share != nullptr) {
    pool_.Share(share, *source.share, stream);
    return;
  }
  pool_.Take(share, source.pages, stream);
  share.length = source.length;
  if (source.initial || layout().PackedBytes(source.pages) == 0) return;
  pool_.Unpack(source.memory, share, stream);
  device_.Synchronize(stream);  // the host copy goes away after
}

void PoolStore::Reset(SessionState& state, DeviceRoom& room, StreamHandle stream) {
  PoolLease(*this, room).Reset(state, stream);
}

// ---------------------------------------------------------------- tiers

void PoolStore::DropDeviceOnly(SessionState& state, DeviceRoom& room, StreamHandle stream) {
  // Checkpoints stay on the device only.
  PoolLease(*this, room).DropCheckpoints(state, 0, state.share().checkpoints.size(), stream);
}

void* PoolStore::ToHost(SessionState& state, StreamHandle stream) {
  PoolShare& share = state.share();
  void* host = nullptr;
  const size_t bytes = layout().PackedBytes(share.pages.size());
  if (bytes > 0) host = device_.AllocateHost(bytes);
  try {
    if (bytes > 0) {
      pool_.Pack(share, host, stream);
      device_.Synchronize(stream);
    }
  } catch (...) {
    device_.FreeHost(host);
    throw;
  }
  // The copy is done: the units go back (after this stream's work, which
  // includes the copy).
  pool_.Release(share, stream);
  return host;
}

void* PoolStore::ToDevice(SessionState& state, StreamHandle stream) {
  PoolShare& share = state.share();
  PoolShare taken;
  try {
    pool_.Take(taken, layout().PagesFor(share.length), stream);
    if (layout().PackedBytes(taken.pages.size()) > 0) {
      pool_.Unpack(state.memory(), taken, stream);
      device_.Synchronize(stream);  // the host copy is freed right after
    }
  } catch (...) {
    pool_.Release(taken, stream);
    throw;
  }
  share.pages = std::move(taken.pages);
  share.slot = taken.slot;
  return nullptr;  // no block: the share is in the pool
}

void PoolStore::Release(SessionState& state, void* host, StreamHandle last) {
  // Its units are free once the work queued on them is done.
  pool_.Release(state.share(), last);
  device_.FreeHost(host);
}

// ---------------------------------------------------------------- copies and files

void PoolStore::CopyOut(SessionState& state, HostCopy& copy, StreamHandle stream) {
  const PoolShare& share = state.share();
  state.Use(device_, stream);
  copy.length = share.length;
  copy.pages = layout().PagesFor(share.length);
  copy.packed.resize(layout().PackedBytes(copy.pages));
  copy.bytes = copy.packed.size();
  if (copy.packed.empty()) return;
  if (state.resident()) {
    pool_.Pack(share, copy.packed.data(), stream);
    device_.Synchronize(stream);
  } else {
    std::copy_n(state.memory(), copy.packed.size(), copy.packed.data());
  }
}

SessionFiles::CheckedFile PoolStore::CheckFile(const SessionFiles& files, const std::string& path,
                                               bool strict) const {
  return files.CheckPooled(path, strict);
}

HostCopy PoolStore::ReadFile(const SessionFiles& files, SessionFiles::CheckedFile& file) {
  HostCopy copy;
  copy.pages = file.pages;
  copy.length = file.positions;
  copy.packed.resize(layout().PackedBytes(file.pages));
  copy.bytes = copy.packed.size();
  files.ReadPooled(file, copy.packed.data());
  return copy;
}

void PoolStore::WriteFile(SessionFiles& files, const std::string& path, const HostCopy& copy,
                          const std::string& attachment) const {
  files.SavePooled(path, copy.packed.data(), copy.pages, copy.length, attachment);
}

// ---------------------------------------------------------------- the lease

PoolLease::PoolLease(PoolStore& store, DeviceRoom& room, const DeviceRoom::Held& held,
                     int64_t bytes, StreamHandle stream)
    : store_(store), room_(room) {
  if (bytes <= 0) return;
  room_.Reserve(held, bytes, stream);
  left_ = bytes;
}

PoolLease::~PoolLease() {
  if (left_ <= 0) return;
  try {
    room_.Shrink(left_);
  } catch (...) {
    // Only the accounting's retain hint can fail; the room is given back.
  }
}

void PoolLease::Settle(SessionState& state, int64_t bytes) {
  left_ -= bytes - state.bytes();
  state.set_bytes(bytes);
}

void PoolLease::Grow(SessionState& state, int64_t count, StreamHandle stream) {
  StatePool& pool = store_.pool();
  PoolShare& share = state.share();
  pool.PrepareWrite(share, share.length, share.length + count, stream);
  Settle(state, pool.ShareBytes(share, share.pages.size()));
}

void PoolLease::Replace(SessionState& state, size_t pages, int64_t length, StreamHandle stream) {
  StatePool& pool = store_.pool();
  std::vector<int32_t> fresh = pool.TakePages(pages, /*zero=*/false, stream);
  PoolShare& share = state.share();
  pool.ReleasePages(share.pages, stream);
  share.pages = std::move(fresh);
  share.length = length;
  Settle(state, pool.SessionBytes(pages));
}

void PoolLease::Checkpoint(SessionState& state, StreamHandle stream) {
  StatePool& pool = store_.pool();
  PoolShare& share = state.share();
  const int32_t slot = pool.TakeSlot(stream);
  pool.CopySlot(slot, share.slot, stream);
  share.checkpoints.push_back({share.length, slot});
  Settle(state, state.bytes() + static_cast<int64_t>(store_.layout().slot_bytes));
}

void PoolLease::Trim(SessionState& state, StreamHandle stream) {
  PoolShare& share = state.share();
  const size_t keep = store_.layout().PagesFor(share.length);
  if (keep >= share.pages.size()) return;
  std::vector<int32_t> dropped(share.pages.begin() + static_cast<std::ptrdiff_t>(keep),
                               share.pages.end());
  share.pages.resize(keep);
  store_.pool().ReleasePages(dropped, stream);
  Settle(state, store_.pool().ShareBytes(share, keep));
}

void PoolLease::DropCheckpoints(SessionState& state, size_t first, size_t last,
                                StreamHandle stream) {
  const int64_t freed = store_.pool().ReleaseCheckpoints(state.share(), first, last, stream);
  if (freed != 0) Settle(state, state.bytes() - freed);
}

void PoolLease::Reset(SessionState& state, StreamHandle stream) {
  StatePool& pool = store_.pool();
  PoolShare& share = state.share();
  DropCheckpoints(state, 0, share.checkpoints.size(), stream);
  pool.ReleasePages(share.pages, stream);
  share.pages.clear();
  share.length = 0;
  if (share.slot >= 0) {
    // A fresh slot is a zeroed one; the old one is free once this stream is done with it.
    PoolShare old;
    old.slot = share.slot;
    share.slot = pool.TakeSlot(stream);
    pool.Release(old, stream);
  }
  Settle(state, pool.SessionBytes(0));
}

}  // namespace aoti_sessions
