// The pooled state's memory and allocator: units taken and released, shared
// pages copied on write, growth by doubling, and packing a session's units.
#include "state_pool.h"

#include <algorithm>

#include "errors.h"
#include "util.h"

namespace aoti_sessions {
namespace {

// Units a pool starts with beyond the reserved ones (it doubles from there).
constexpr int64_t kFirstPages = 64;
constexpr int64_t kFirstSlots = 16;

}  // namespace

StatePool::StatePool(Device& device, PoolLayout layout, std::optional<int64_t> max_bytes)
    : device_(device), layout_(std::move(layout)), max_bytes_(max_bytes) {
  WriterLock memory(memory_mutex_);
  MutexLock lock(mutex_);
  if (layout_.has_pages()) {
    pages_.capacity = std::max<int64_t>(kFirstPages, layout_.max_pages) + 2;
    for (int32_t p = static_cast<int32_t>(pages_.capacity) - 1; p > kScratchPage; --p) {
      pages_.free.emplace_back(p, nullptr);
    }
    page_owners_.assign(static_cast<size_t>(pages_.capacity), 0);
  }
  if (layout_.has_slots()) {
    slots_.capacity = kFirstSlots + 1;
    for (int32_t s = static_cast<int32_t>(slots_.capacity) - 1; s > kScratchSlot; --s) {
      slots_.free.emplace_back(s, nullptr);
    }
  }
  try {
    for (const PooledTensor& t : layout_.tensors) {
      const int64_t units = t.kind == PoolKind::kPages ? pages_.capacity : slots_.capacity;
      const size_t bytes = static_cast<size_t>(units) * t.unit_bytes;
      memory_.push_back(device_.Allocate(bytes, nullptr));
      units_.push_back(units);
      // The zero page must hold zeros; the rest is zeroed when taken.
      device_.Zero(memory_.back(), bytes, nullptr);
    }
    device_.Synchronize(nullptr);
  } catch (...) {
    for (void* m : memory_) device_.Free(m, nullptr);
    throw;
  }
}

StatePool::~StatePool() {
  WriterLock memory(memory_mutex_);
  std::vector<StreamHandle> streams;
  {
    MutexLock lock(mutex_);
    streams = streams_;
  }
  try {
    for (StreamHandle s : streams) device_.Synchronize(s);
    for (void* m : memory_) device_.Free(m, nullptr);
  } catch (...) {
    // A broken device runtime (a sticky CUDA error) must not abort teardown.
  }
}

// ---------------------------------------------------------------- units

bool StatePool::TryTake(Units& units, size_t count, StreamHandle stream,
                        std::vector<int32_t>& taken, std::vector<StreamHandle>& after) {
  if (units.free.size() < count) return false;
  for (size_t i = 0; i < count; ++i) {
    auto [unit, freed_on] = units.free.back();
    units.free.pop_back();
    taken.push_back(unit);
    // A unit freed on another stream may still be in use there.
    if (freed_on != stream && std::find(after.begin(), after.end(), freed_on) == after.end()) {
      after.push_back(freed_on);
    }
  }
  return true;
}

std::vector<int32_t> StatePool::TakePages(size_t count, bool zero, StreamHandle stream) {
  std::vector<int32_t> taken;
  if (count == 0) return taken;
  if (!layout_.has_pages()) Throw(ErrorKind::kInternal, "the pool has no page tensors");
  std::vector<StreamHandle> after;
  for (;;) {
    int64_t want = 0;
    {
      MutexLock lock(mutex_);
      if (TryTake(pages_, count, stream, taken, after)) {
        for (int32_t p : taken) page_owners_[static_cast<size_t>(p)] = 1;
        pages_used_ += static_cast<int64_t>(count);
        break;
      }
      want = pages_.capacity + static_cast<int64_t>(count - pages_.free.size());
    }
    Grow(PoolKind::kPages, want, stream);
  }
  NoteStream(stream);
  try {
    ReaderLock memory(memory_mutex_);
    for (StreamHandle s : after) device_.Order(s, stream);
    if (zero) ZeroUnits(PoolKind::kPages, taken, stream);
  } catch (...) {
    ReleasePages(taken, stream);
    throw;
  }
  return taken;
}

int32_t StatePool::TakeSlot(StreamHandle stream) {
  if (!layout_.has_slots()) Throw(ErrorKind::kInternal, "the pool has no slot tensors");
  std::vector<int32_t> taken;
  std::vector<StreamHandle> after;
  for (;;) {
    int64_t want = 0;
    {
      MutexLock lock(mutex_);
      if (TryTake(slots_, 1, stream, taken, after)) {
        ++slots_used_;
        break;
      }
      want = slots_.capacity + 1;
    }
    Grow(PoolKind::kSlots, want, stream);
  }
  NoteStream(stream);
  try {
    ReaderLock memory(memory_mutex_);
    for (StreamHandle s : after) device_.Order(s, stream);
    ZeroUnits(PoolKind::kSlots, taken, stream);
  } catch (...) {
    MutexLock lock(mutex_);
    FreeSlot(taken[0], stream);
    throw;
  }
  return taken[0];
}

void StatePool::Take(PoolShare& share, size_t pages, StreamHandle stream) {
  share.pages = TakePages(pages, /*zero=*/false, stream);
  if (layout_.has_slots()) share.slot = TakeSlot(stream);
}

void StatePool::Share(PoolShare& dst, const PoolShare& src, StreamHandle stream) {
  Take(dst, 0, stream);  // its slot
  SharePages(src.pages);
  dst.pages = src.pages;
  dst.length = src.length;
  if (dst.slot >= 0) CopySlot(dst.slot, src.slot, stream);
}

void StatePool::SharePages(const std::vector<int32_t>& pages) {
  MutexLock lock(mutex_);
  for (int32_t p : pages) ++page_owners_[static_cast<size_t>(p)];
}

void StatePool::ReleasePages(const std::vector<int32_t>& pages, StreamHandle stream) {
  MutexLock lock(mutex_);
  for (int32_t p : pages) {
    int32_t& owners = page_owners_[static_cast<size_t>(p)];
    if (owners <= 0) continue;  // never: a page is released by one of its owners
    if (--owners == 0) {
      pages_.free.emplace_back(p, stream);
      --pages_used_;
    }
  }
}

void StatePool::Release(PoolShare& share, StreamHandle stream) {
  ReleasePages(share.pages, stream);
  share.pages.clear();
  ReleaseCheckpoints(share, 0, share.checkpoints.size(), stream);
  if (share.slot >= 0) {
    MutexLock lock(mutex_);
    FreeSlot(share.slot, stream);
  }
  share.slot = -1;
}

void StatePool::FreeSlot(int32_t slot, StreamHandle stream) {
  slots_.free.emplace_back(slot, stream);
  --slots_used_;
}

int64_t StatePool::ReleaseCheckpoints(PoolShare& share, size_t first, size_t last,
                                      StreamHandle stream) {
  last = std::min(last, share.checkpoints.size());
  if (first >= last) return 0;
  const auto begin = share.checkpoints.begin() + static_cast<std::ptrdiff_t>(first);
  const auto end = share.checkpoints.begin() + static_cast<std::ptrdiff_t>(last);
  {
    MutexLock lock(mutex_);
    for (auto it = begin; it != end; ++it) FreeSlot(it->slot, stream);
  }
  share.checkpoints.erase(begin, end);
  return static_cast<int64_t>((last - first) * layout_.slot_bytes);
}

void StatePool::Grow(PoolKind kind, int64_t want, StreamHandle stream) {
  // Every run and copy holds the memory lock shared: once it is held
  // exclusively, only the device may still be working on the old memory.
  WriterLock memory(memory_mutex_);
  std::vector<StreamHandle> streams;
  int64_t capacity = 0;
  {
    MutexLock lock(mutex_);
    capacity = (kind == PoolKind::kPages ? pages_ : slots_).capacity;
    streams = streams_;
  }
  if (capacity >= want) return;  // another thread grew it meanwhile
  const size_t unit_bytes = kind == PoolKind::kPages ? layout_.page_bytes : layout_.slot_bytes;
  const int64_t reserved = kind == PoolKind::kPages ? 2 : 1;
  int64_t limit = INT32_MAX;
  // (Units of no bytes, the pages of a model with no attention layer, take no budget.)
  if (max_bytes_ && unit_bytes > 0) {
    limit = std::min<int64_t>(limit, *max_bytes_ / static_cast<int64_t>(unit_bytes) + reserved);
  }
  const int64_t grown = std::min(std::max(want, capacity * 2), limit);
  if (grown < want) {
    Throw(ErrorKind::kCapacity, std::string("the state pool cannot grow to ") +
                                    std::to_string(want - reserved) + " " +
                                    (kind == PoolKind::kPages ? "pages" : "slots") +
                                    ": memory_budget=" + BytesText(*max_bytes_) + " holds " +
                                    std::to_string(limit - reserved));
  }
  for (StreamHandle s : streams) device_.Synchronize(s);
  std::vector<std::pair<size_t, void*>> fresh;  // (tensor, new memory)
  try {
    for (size_t i = 0; i < layout_.tensors.size(); ++i) {
      const PooledTensor& t = layout_.tensors[i];
      if (t.kind != kind) continue;
      void* m = device_.Allocate(static_cast<size_t>(grown) * t.unit_bytes, stream);
      fresh.emplace_back(i, m);
      device_.Copy(m, memory_[i], static_cast<size_t>(capacity) * t.unit_bytes, stream);
    }
    device_.Synchronize(stream);
  } catch (...) {
    for (auto& [i, m] : fresh) device_.Free(m, stream);
    throw;
  }
  for (auto& [i, m] : fresh) {
    device_.Free(memory_[i], stream);
    memory_[i] = m;
    units_[i] = grown;
  }
  ++epoch_;
  grows_.fetch_add(1);
  MutexLock lock(mutex_);
  Units& units = kind == PoolKind::kPages ? pages_ : slots_;
  for (int64_t u = grown - 1; u >= capacity; --u) units.free.emplace_back(static_cast<int32_t>(u), stream);
  units.capacity = grown;
  if (kind == PoolKind::kPages) page_owners_.resize(static_cast<size_t>(grown), 0);
}

void StatePool::NoteStream(StreamHandle stream) {
  MutexLock lock(mutex_);
  if (std::find(streams_.begin(), streams_.end(), stream) == streams_.end()) {
    streams_.push_back(stream);
  }
}

// ---------------------------------------------------------------- memory

char* StatePool::UnitAddress(size_t tensor, int32_t unit) const {
  return static_cast<char*>(memory_[tensor]) +
         static_cast<size_t>(unit) * layout_.tensors[tensor].unit_bytes;
}

void StatePool::ZeroUnits(PoolKind kind, const std::vector<int32_t>& units, StreamHandle stream) {
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    if (layout_.tensors[i].kind != kind) continue;
    for (int32_t u : units) device_.Zero(UnitAddress(i, u), layout_.tensors[i].unit_bytes, stream);
  }
}

void StatePool::CopyPage(int32_t dst, int32_t src, StreamHandle stream) {
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    if (layout_.tensors[i].kind != PoolKind::kPages) continue;
    device_.Copy(UnitAddress(i, dst), UnitAddress(i, src), layout_.tensors[i].unit_bytes, stream);
  }
}

int64_t StatePool::PrepareWrite(PoolShare& share, int64_t from, int64_t to, StreamHandle stream) {
  if (to <= from || !layout_.has_pages()) return 0;
  const size_t first = static_cast<size_t>(from / layout_.page_size);
  const size_t last = static_cast<size_t>((to - 1) / layout_.page_size);
  const size_t have = share.pages.size();
  // Shared pages among those written: nobody else can gain an owner of them
  // meanwhile (that takes a fork of this share, under its owner's lock).
  std::vector<size_t> shared;
  {
    MutexLock lock(mutex_);
    for (size_t i = first; i <= last && i < have; ++i) {
      if (page_owners_[static_cast<size_t>(share.pages[i])] > 1) shared.push_back(i);
    }
  }
  std::vector<int32_t> fresh = TakePages(last + 1 > have ? last + 1 - have : 0, true, stream);
  std::vector<int32_t> copies;
  try {
    copies = TakePages(shared.size(), false, stream);
  } catch (...) {
    ReleasePages(fresh, stream);
    throw;
  }
  std::vector<int32_t> old;
  {
    ReaderLock memory(memory_mutex_);
    for (size_t k = 0; k < shared.size(); ++k) {
      CopyPage(copies[k], share.pages[shared[k]], stream);
      old.push_back(share.pages[shared[k]]);
      share.pages[shared[k]] = copies[k];
    }
  }
  // Released after the copies were queued on the same stream: whoever takes
  // a page freed here waits for them.
  ReleasePages(old, stream);
  share.pages.insert(share.pages.end(), fresh.begin(), fresh.end());
  pages_copied_.fetch_add(static_cast<int64_t>(shared.size()));
  return static_cast<int64_t>(shared.size());
}

void StatePool::Transfer(const PoolShare& share, const std::vector<char*>& parts, bool into_pool,
                         StreamHandle stream) {
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    const PooledTensor& t = layout_.tensors[i];
    char* cursor = parts[i];
    auto copy = [&](char* unit, size_t bytes) {
      if (into_pool) {
        device_.Copy(unit, cursor, bytes, stream);
      } else {
        device_.Copy(cursor, unit, bytes, stream);
      }
      cursor += bytes;
    };
    if (t.kind == PoolKind::kSlots) {
      if (share.slot < 0) Throw(ErrorKind::kInternal, "a session of a slot pool without a slot");
      copy(UnitAddress(i, share.slot), t.unit_bytes);
      continue;
    }
    // Runs of consecutive pages are one copy (pages taken together often are).
    for (size_t a = 0; a < share.pages.size();) {
      size_t b = a + 1;
      while (b < share.pages.size() && share.pages[b] == share.pages[b - 1] + 1) ++b;
      copy(UnitAddress(i, share.pages[a]), (b - a) * t.unit_bytes);
      a = b;
    }
  }
}

void StatePool::PackTensors(const PoolShare& share, const std::vector<void*>& dst,
                            StreamHandle stream) {
  std::vector<char*> parts;
  for (void* d : dst) parts.push_back(static_cast<char*>(d));
  NoteStream(stream);
  ReaderLock memory(memory_mutex_);
  Transfer(share, parts, /*into_pool=*/false, stream);
}

void StatePool::UnpackTensors(const std::vector<const void*>& src, const PoolShare& share,
                              StreamHandle stream) {
  std::vector<char*> parts;
  for (const void* p : src) parts.push_back(static_cast<char*>(const_cast<void*>(p)));
  NoteStream(stream);
  ReaderLock memory(memory_mutex_);
  Transfer(share, parts, /*into_pool=*/true, stream);
}

void StatePool::Pack(const PoolShare& share, void* dst, StreamHandle stream) {
  std::vector<void*> parts;
  for (size_t offset : layout_.PackedOffsets(share.pages.size())) {
    parts.push_back(static_cast<char*>(dst) + offset);
  }
  PackTensors(share, parts, stream);
}

void StatePool::Unpack(const void* src, const PoolShare& share, StreamHandle stream) {
  std::vector<const void*> parts;
  for (size_t offset : layout_.PackedOffsets(share.pages.size())) {
    parts.push_back(static_cast<const char*>(src) + offset);
  }
  UnpackTensors(parts, share, stream);
}

void StatePool::CopySlot(int32_t dst, int32_t src, StreamHandle stream) {
  NoteStream(stream);
  ReaderLock memory(memory_mutex_);
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    if (layout_.tensors[i].kind != PoolKind::kSlots) continue;
    device_.Copy(UnitAddress(i, dst), UnitAddress(i, src), layout_.tensors[i].unit_bytes, stream);
  }
}

void StatePool::FillPageRow(const PoolShare& share, int32_t* table, size_t width) const {
  for (size_t i = 0; i < width; ++i) table[i] = i < share.pages.size() ? share.pages[i] : kZeroPage;
}

void StatePool::FillPaddingRow(int32_t* table, size_t width) const {
  // Every entry: a padding row of a prefill writes several positions, and
  // never into the zero page.
  std::fill_n(table, width, kScratchPage);
}

StatePool::Use::Use(StatePool& pool, StreamHandle stream) : pool_(pool) {
  pool_.NoteStream(stream);
  pool_.memory_mutex_.lock_shared();
}

StatePool::Use::~Use() { pool_.memory_mutex_.unlock_shared(); }

std::vector<OwnedTensor> StatePool::Use::Tensors() const NO_THREAD_SAFETY_ANALYSIS {
  std::vector<OwnedTensor> tensors;
  for (size_t i = 0; i < pool_.layout_.tensors.size(); ++i) {
    const PooledTensor& t = pool_.layout_.tensors[i];
    TensorLayout layout;
    layout.dtype = t.unit.dtype;
    layout.sizes.push_back(pool_.units_[i]);
    layout.sizes.insert(layout.sizes.end(), t.unit.sizes.begin(), t.unit.sizes.end());
    layout.strides = ContiguousStrides(layout.sizes);  // (units of no elements stride as torch's do)
    tensors.push_back(OwnedTensor::FromBlob(pool_.memory_[i], layout,
                                            pool_.device_.torch_device_type(),
                                            pool_.device_.spec().index));
  }
  return tensors;
}

uint64_t StatePool::Use::epoch() const NO_THREAD_SAFETY_ANALYSIS { return pool_.epoch_; }

size_t StatePool::allocated_bytes() const {
  MutexLock lock(mutex_);
  return static_cast<size_t>(pages_.capacity) * layout_.page_bytes +
         static_cast<size_t>(slots_.capacity) * layout_.slot_bytes;
}

void StatePool::AddStats(EngineStats& stats) const {
  MutexLock lock(mutex_);
  stats.pool_pages = pages_.capacity;
  stats.pool_pages_used = pages_used_;
  stats.pool_slots = slots_.capacity;
  stats.pool_slots_used = slots_used_;
  stats.pool_grows = grows_.load();
  stats.pages_copied = pages_copied_.load();
}

}  // namespace aoti_sessions
