// One session's state and its tier moves.
#include "session_state.h"

#include <utility>

#include "errors.h"
#include "util.h"

namespace aoti_sessions {
namespace {

// Bind keys are process-wide, so no two blocks ever share one.
uint64_t NextBindKey() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

}  // namespace

SessionState::SessionState(uint64_t id, void* block, std::vector<OwnedTensor> tensors,
                           StreamHandle stream, int64_t bytes)
    : id_(id), bytes_(bytes), stream_(stream) {
  MutexLock lock(mutex_);  // no other thread sees it yet; keeps the analysis exact
  block_ = block;
  tensors_ = std::move(tensors);
  bind_key_ = NextBindKey();
  Touch();
}

void SessionState::CheckOpen() const {
  if (!closed_) return;
  std::string what = "session " + std::to_string(id_) + " is closed";
  if (!closed_reason_.empty()) what += " (" + closed_reason_ + ")";
  Throw(ErrorKind::kSessionClosed, what);
}

char* SessionState::memory() const { return static_cast<char*>(resident_ ? block_ : host_block_); }

void SessionState::Touch() { last_use_ns_.store(SteadyNowNs()); }

void SessionState::Use(Device& device, StreamHandle stream) { stream_.Use(device, stream); }

void* SessionState::MoveToHost(void* host_block) {
  // The containers may still point at the device block: the next MoveToDevice
  // gives a new bind key, so every method rebinds before a run.
  tensors_.clear();
  host_block_ = host_block;
  resident_ = false;
  return std::exchange(block_, nullptr);
}

void* SessionState::MoveToDevice(void* block, std::vector<OwnedTensor> tensors) {
  block_ = block;
  tensors_ = std::move(tensors);
  bind_key_ = NextBindKey();
  resident_ = true;
  return std::exchange(host_block_, nullptr);
}

SessionState::Released SessionState::Close(const std::string& reason) {
  Released released;
  if (closed_) return released;
  closed_ = true;
  closed_reason_ = reason;
  released.was_open = true;
  released.was_resident = resident_;
  resident_ = false;
  tensors_.clear();
  released.device_block = std::exchange(block_, nullptr);
  released.host_block = std::exchange(host_block_, nullptr);
  return released;
}

}  // namespace aoti_sessions
