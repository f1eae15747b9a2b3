// Host memory for session state: blocks of one session's size for offloaded
// state and for staging saves and loads, pinned on CUDA (so copies run at full
// bandwidth). Pinned allocations are slow, so a few spare blocks are kept for
// the next offload, restore-evict pair or save.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "device.h"
#include "mutex.h"

namespace aoti_sessions {

class HostPool {
 public:
  HostPool(Device& device, size_t block_bytes) : device_(device), block_bytes_(block_bytes) {}
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // A block of block_bytes (nullptr when that is 0): a spare one, or new.
  // Throws kDevice when the allocation fails.
  void* Take();
  // Back to the spares, or freed when there are enough. nullptr is ignored.
  void Give(void* block) noexcept;
  size_t spare_bytes() const;

 private:
  Device& device_;
  const size_t block_bytes_;
  mutable Mutex mutex_;  // a leaf: nothing is taken under it
  std::vector<void*> spare_ GUARDED_BY(mutex_);
};

// A block from a HostPool for one scope; back to the pool unless released.
class HostBlock {
 public:
  explicit HostBlock(HostPool& pool) : pool_(pool), ptr_(pool.Take()) {}
  ~HostBlock() { pool_.Give(ptr_); }
  HostBlock(const HostBlock&) = delete;
  HostBlock& operator=(const HostBlock&) = delete;
  void* get() const { return ptr_; }
  void* release() { return std::exchange(ptr_, nullptr); }

 private:
  HostPool& pool_;
  void* ptr_;
};

}  // namespace aoti_sessions
