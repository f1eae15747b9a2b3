// The engine's pooled session state (docs/batching.md): the memory of every
// pooled tensor, which of its units (pages, slots) are free and how many
// sessions share each page, and the copies between a session's units and a
// packed buffer (offload, save, state()). It knows nothing of sessions: a
// session's part is a PoolShare, which its owner keeps under its own lock.
//
// Locks: the memory lock (memory_mutex_, a reader-writer lock) is held shared
// by everything that reads or writes pool memory (runs, copies, zeroing) and
// exclusively by Grow, which moves the memory. It comes after a session's
// lock and the runner's weights lock and before the registry lock. The
// allocator's lock (mutex_) is a leaf. Never call a taking function (which
// may grow the pool) while holding the memory lock.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "device.h"
#include "model.h"
#include "mutex.h"
#include "options.h"
#include "torch_shim.h"

namespace aoti_sessions {

// A copy of a session's slot as it was at `length` positions, kept so the
// session can rewind there (Session::Checkpoint).
struct SlotCheckpoint {
  int64_t length = 0;
  int32_t slot = -1;
};

// One session's part of the pool.
struct PoolShare {
  std::vector<int32_t> pages;  // in position order: pages[i] holds positions [i * page_size, ...)
  int64_t length = 0;          // positions held
  int32_t slot = -1;           // its slot (-1: none, or offloaded)
  std::vector<SlotCheckpoint> checkpoints;  // oldest first, each at most `length`; resident only
};

class StatePool {
 public:
  // Reserved units, never owned by a session. Page 0 is all zero and never
  // written: page-table entries past a session's pages point at it. Page 1
  // and slot 0 are scratch: padding rows of a padded batch write there and no
  // real row reads them.
  static constexpr int32_t kZeroPage = 0;
  static constexpr int32_t kScratchPage = 1;
  static constexpr int32_t kScratchSlot = 0;

  // `max_bytes` caps the memory the pool grows to (memory_budget), if set.
  StatePool(Device& device, PoolLayout layout, std::optional<int64_t> max_bytes);
  ~StatePool();
  StatePool(const StatePool&) = delete;
  StatePool& operator=(const StatePool&) = delete;

  const PoolLayout& layout() const { return layout_; }
  // Bytes of a session holding `pages` pages (and its slot), on the device
  // or packed.
  int64_t SessionBytes(size_t pages) const {
    return static_cast<int64_t>(layout_.PackedBytes(pages));
  }
  // Device bytes of `share` once it holds `pages` pages: its slot's and
  // pages' and those of its checkpoints.
  int64_t ShareBytes(const PoolShare& share, size_t pages) const {
    return SessionBytes(pages) +
           static_cast<int64_t>(share.checkpoints.size() * layout_.slot_bytes);
  }

  // -- units ---------------------------------------------------------------
  // `count` pages, each owned once by the caller and zeroed (with `zero`) on
  // `stream`; grows the pool when there are too few free. Throws kCapacity
  // when the pool cannot grow that far, kDevice when memory runs out.
  std::vector<int32_t> TakePages(size_t count, bool zero, StreamHandle stream)
      EXCLUDES(memory_mutex_, mutex_);
  // A slot owned by the caller, zeroed on `stream`.
  int32_t TakeSlot(StreamHandle stream) EXCLUDES(memory_mutex_, mutex_);
  // Makes an empty `share` own `pages` fresh pages (unwritten) and, where the
  // pool keeps slot state, a zeroed slot.
  void Take(PoolShare& share, size_t pages, StreamHandle stream) EXCLUDES(memory_mutex_, mutex_);
  // Makes an empty `dst` a fork of `src`: its length, its pages shared (each
  // copied only when one of the two writes it) and a copy of its slot.
  void Share(PoolShare& dst, const PoolShare& src, StreamHandle stream)
      EXCLUDES(memory_mutex_, mutex_);
  // Each of `pages` gets one more owner (a fork shares them).
  void SharePages(const std::vector<int32_t>& pages) EXCLUDES(mutex_);
  // Gives up one ownership of each of `pages`; a page nobody owns is free
  // once the work queued on `stream` so far is done.
  void ReleasePages(const std::vector<int32_t>& pages, StreamHandle stream) EXCLUDES(mutex_);
  // Gives up everything `share` owns (its pages, slot and checkpoints) and empties it.
  void Release(PoolShare& share, StreamHandle stream) EXCLUDES(mutex_);
  // Gives up checkpoints [first, last) of `share`; returns their bytes.
  int64_t ReleaseCheckpoints(PoolShare& share, size_t first, size_t last, StreamHandle stream)
      EXCLUDES(mutex_);

  // -- memory ---------------------------------------------------------------
  // Makes `share` own, privately, every page that positions [from, to) fall
  // in: new pages for positions past its pages (zeroed), and a copy of each
  // shared page among them (copy on write). Returns the pages copied.
  int64_t PrepareWrite(PoolShare& share, int64_t from, int64_t to, StreamHandle stream)
      EXCLUDES(memory_mutex_, mutex_);
  // Queues copies of the share's units into `dst` (packed: PoolLayout), or from `src`
  // into the units the share owns (which must match the packed size). Either
  // side may be host or device memory.
  void Pack(const PoolShare& share, void* dst, StreamHandle stream) EXCLUDES(memory_mutex_);
  void Unpack(const void* src, const PoolShare& share, StreamHandle stream)
      EXCLUDES(memory_mutex_);
  // The same with each pooled tensor's part at its own address.
  void PackTensors(const PoolShare& share, const std::vector<void*>& dst, StreamHandle stream)
      EXCLUDES(memory_mutex_);
  void UnpackTensors(const std::vector<const void*>& src, const PoolShare& share,
                     StreamHandle stream) EXCLUDES(memory_mutex_);
  // Copies slot `src` into slot `dst` (a fork).
  void CopySlot(int32_t dst, int32_t src, StreamHandle stream) EXCLUDES(memory_mutex_);
  // Fills one row of a run's addressing: `table` (`width` entries, at least
  // the share's pages) with the share's pages, then the zero page.
  void FillPageRow(const PoolShare& share, int32_t* table, size_t width) const;
  // The same for a padding row: the scratch page in every entry.
  void FillPaddingRow(int32_t* table, size_t width) const;

  // Holds the pool's memory still (shared memory lock) for a run or a copy
  // on `stream`: the tensors aliasing it and the epoch they belong to.
  class SCOPED_CAPABILITY Use {
   public:
    Use(StatePool& pool, StreamHandle stream) ACQUIRE_SHARED(pool.memory_mutex_);
    ~Use() RELEASE();
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;
    // One tensor per pooled tensor, `[units, ...]`, aliasing the pool.
    std::vector<OwnedTensor> Tensors() const;
    // Bumped every time the memory moves (a graph keyed by it stays valid).
    uint64_t epoch() const;

   private:
    StatePool& pool_;
  };

  // Device bytes the pool holds, and its counters.
  size_t allocated_bytes() const EXCLUDES(mutex_);
  void AddStats(EngineStats& stats) const EXCLUDES(mutex_);

 private:
  struct Units {
    int64_t capacity = 0;  // units allocated in every tensor of the kind
    std::vector<std::pair<int32_t, StreamHandle>> free;  // free units, freed on that stream
  };
  // Pops `count` free units of `units` (reserved ones never being free);
  // false if there are too few.
  bool TryTake(Units& units, size_t count, StreamHandle stream, std::vector<int32_t>& taken,
               std::vector<StreamHandle>& after) REQUIRES(mutex_);
  // Grows the kind's units to at least `want` (doubling), moving the memory.
  void Grow(PoolKind kind, int64_t want, StreamHandle stream) EXCLUDES(memory_mutex_, mutex_);
  void NoteStream(StreamHandle stream) EXCLUDES(mutex_);
  // Puts a slot a share owned back among the free ones (free once `stream`'s work is done).
  void FreeSlot(int32_t slot, StreamHandle stream) REQUIRES(mutex_);
  // Zeroes units of `kind` on `stream` (memory lock held shared).
  void ZeroUnits(PoolKind kind, const std::vector<int32_t>& units, StreamHandle stream)
      REQUIRES_SHARED(memory_mutex_);
  // Copies a page (every page tensor) from `src` to `dst` on `stream`.
  void CopyPage(int32_t dst, int32_t src, StreamHandle stream) REQUIRES_SHARED(memory_mutex_);
  // Queues copies between each pooled tensor's part (`parts`) and the
  // share's units: to the pool with `into_pool`, else out of it.
  void Transfer(const PoolShare& share, const std::vector<char*>& parts, bool into_pool,
                StreamHandle stream) REQUIRES_SHARED(memory_mutex_);
  char* UnitAddress(size_t tensor, int32_t unit) const REQUIRES_SHARED(memory_mutex_);

  Device& device_;
  const PoolLayout layout_;
  std::optional<int64_t> max_bytes_;
  mutable SharedMutex memory_mutex_;
  std::vector<void*> memory_ GUARDED_BY(memory_mutex_);   // per pooled tensor
  std::vector<int64_t> units_ GUARDED_BY(memory_mutex_);  // units allocated, per pooled tensor
  uint64_t epoch_ GUARDED_BY(memory_mutex_) = 0;
  mutable Mutex mutex_;  // a leaf: the allocator
  Units pages_ GUARDED_BY(mutex_);
  Units slots_ GUARDED_BY(mutex_);
  std::vector<int32_t> page_owners_ GUARDED_BY(mutex_);  // per page: sessions owning it
  int64_t pages_used_ GUARDED_BY(mutex_) = 0;
  int64_t slots_used_ GUARDED_BY(mutex_) = 0;
  std::vector<StreamHandle> streams_ GUARDED_BY(mutex_);  // streams that used the memory
  std::atomic<int64_t> grows_{0};
  std::atomic<int64_t> pages_copied_{0};
};

}  // namespace aoti_sessions
