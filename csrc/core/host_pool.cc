// Spare host blocks for offloaded session state and file staging.
#include "host_pool.h"

namespace aoti_sessions {
namespace {

// Enough for an offload, a restore-evict pair or a save without allocating.
constexpr size_t kSpareBlocks = 2;

}  // namespace

HostPool::~HostPool() {
  MutexLock lock(mutex_);
  for (void* block : spare_) device_.FreeHost(block);
  spare_.clear();
}

void* HostPool::Take() {
  if (block_bytes_ == 0) return nullptr;
  {
    MutexLock lock(mutex_);
    if (!spare_.empty()) {
      void* block = spare_.back();
      spare_.pop_back();
      return block;
    }
  }
  return device_.AllocateHost(block_bytes_);
}

void HostPool::Give(void* block) noexcept {
  if (block == nullptr) return;
  {
    MutexLock lock(mutex_);
    if (spare_.size() < kSpareBlocks) {
      spare_.push_back(block);
      return;
    }
  }
  device_.FreeHost(block);
}

size_t HostPool::spare_bytes() const {
  MutexLock lock(mutex_);
  return spare_.size() * block_bytes_;
}

}  // namespace aoti_sessions
