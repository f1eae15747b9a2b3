// Making room under memory_budget: reserving device bytes for a session by
// closing the least recently used idle discardable session, else offloading
// the least recently used idle session, or waiting for one to become idle
// when every resident session is in use; and closing a discardable session
// to stay within max_sessions.
#include <algorithm>
#include <chrono>

#include "errors.h"
#include "residency.h"
#include "util.h"

namespace aoti_sessions {
namespace {

// How long a call waits for a busy session to become evictable.
constexpr auto kCapacityWait = std::chrono::seconds(60);

}  // namespace

void Residency::ReserveDevice(const Held& held, int64_t need, StreamHandle stream,
                              int64_t host_credit) {
  const auto deadline = std::chrono::steady_clock::now() + kCapacityWait;
  MutexLock lock(registry_mutex_);
  for (;;) {
    if (closed_) Throw(ErrorKind::kSessionClosed, "the engine is closed");
    if (!memory_budget_ || device_bytes_ + need <= *memory_budget_) {
      device_bytes_ += need;
      RetainRegistryLocked();
      return;
    }
    const int64_t budget = *memory_budget_;
    std::string full = "memory_budget=" + BytesText(budget) + " exceeded: " +
                       std::to_string(live_sessions_ - offloaded_sessions_) +
                       " resident sessions hold " + std::to_string(device_bytes_) +
                       " bytes and this call needs " + std::to_string(need) + " more";
    if (need > budget) Throw(ErrorKind::kCapacity, full + " (the budget is below that)");
    {
      // A discardable session goes before any is offloaded (and needs no host room).
      std::vector<std::shared_ptr<SessionState>> open = OpenStatesRegistryLocked();
      lock.Unlock();
      const Discard discarded = DiscardLeastRecentlyUsed(std::move(open), held, /*resident_only=*/true);
      lock.Lock();
      if (discarded == Discard::kDone) continue;
      if (discarded == Discard::kBusy && std::chrono::steady_clock::now() < deadline) {
        WaitForIdle(lock);  // (one being forked: it goes first once idle, not a session offloaded)
        continue;
      }
    }
    if (host_budget_ && host_bytes_ + need - host_credit > *host_budget_) {
      Throw(ErrorKind::kCapacity, full + ", and host_budget=" + BytesText(*host_budget_) +
                                      " cannot take an offloaded session (" +
                                      BytesText(host_bytes_) + " offloaded)");
    }
    std::vector<std::shared_ptr<SessionState>> open = OpenStatesRegistryLocked();
    // Device bytes reserved by creations and restores in flight (or held by
    // sessions being released): they become idle or free soon.
    int64_t resident = 0;
    for (const auto& s : open) resident += s->resident() ? s->bytes() : 0;
    const bool in_flight = device_bytes_ > resident;
    lock.Unlock();
    const Eviction outcome = EvictLeastRecentlyUsed(std::move(open), held, stream, host_credit);
    lock.Lock();
    if (outcome == Eviction::kDone) continue;
    int64_t ours = 0;
    for (const SessionState* h : held) ours += h->resident() ? h->bytes() : 0;
    if (outcome == Eviction::kNoCandidate && device_bytes_ <= ours) {
      Throw(ErrorKind::kCapacity, full + (held.size() == 1
                                              ? "; the only resident session is the one this call uses"
                                              : "; the only resident sessions are the ones this call uses"));
    }
    if (outcome == Eviction::kNoCandidate && !in_flight) {
      Throw(ErrorKind::kCapacity,
            full + "; every resident session is held by a call waiting for room itself");
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      Throw(ErrorKind::kCapacity, full + "; every resident session stayed in use for " +
                                      std::to_string(kCapacityWait.count()) + " s");
    }
    // Every resident session is in use: wait for one to finish its operation.
    WaitForIdle(lock);
  }
}

void Residency::WaitForIdle(MutexLock& lock) {
  capacity_waiters_.fetch_add(1);
  lock.WaitFor(capacity_cv_, std::chrono::milliseconds(5));
  capacity_waiters_.fetch_sub(1);
}

Residency::Discard Residency::DiscardLeastRecentlyUsed(
    std::vector<std::shared_ptr<SessionState>> candidates, const Held& held, bool resident_only) {
  candidates.erase(std::remove_if(candidates.begin(), candidates.end(),
                                  [&](const auto& s) {
                                    return !s->discardable() || s->closed() ||
                                           s->waiting_for_room() ||
                                           (resident_only && !s->resident()) ||
                                           std::find(held.begin(), held.end(), s.get()) !=
                                               held.end();
                                  }),
                   candidates.end());
  std::sort(candidates.begin(), candidates.end(),
            [](const auto& a, const auto& b) { return a->last_use_ns() < b->last_use_ns(); });
  for (const auto& candidate : candidates) {
    if (!candidate->mutex().try_lock()) continue;  // in use (a fork of it): never closed
    MutexLock lock(candidate->mutex(), MutexLock::Adopt{});
    if (candidate->closed() || !candidate->discardable()) continue;
    Release(*candidate, "closed to make room (a discardable session)");
    discards_.fetch_add(1);
    return Discard::kDone;
  }
  return candidates.empty() ? Discard::kNone : Discard::kBusy;
}

Residency::Eviction Residency::EvictLeastRecentlyUsed(
    std::vector<std::shared_ptr<SessionState>> candidates, const Held& held,
    StreamHandle stream, int64_t host_credit) {
  // Sessions held by calls that are themselves waiting for room never become
  // idle before this call proceeds: waiting for them is futile.
  candidates.erase(std::remove_if(candidates.begin(), candidates.end(),
                                  [&](const auto& s) {
                                    return std::find(held.begin(), held.end(), s.get()) !=
                                               held.end() ||
                                           !s->resident() || s->closed() ||
                                           s->waiting_for_room();
                                  }),
                   candidates.end());
  // Discardable ones first (closed, not offloaded), then the least recently used.
  std::sort(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) {
    return a->discardable() != b->discardable() ? a->discardable()
                                                : a->last_use_ns() < b->last_use_ns();
  });
  for (const auto& candidate : candidates) {
    if (TryEvict(*candidate, stream, host_credit)) return Eviction::kDone;
  }
  return candidates.empty() ? Eviction::kNoCandidate : Eviction::kAllBusy;
}

bool Residency::TryEvict(SessionState& victim, StreamHandle stream, int64_t host_credit) {
  if (!victim.mutex().try_lock()) return false;  // in use: never evicted
  MutexLock lock(victim.mutex(), MutexLock::Adopt{});
  if (!victim.closed() && victim.discardable()) {
    Release(victim, "closed to make room (a discardable session)");
    discards_.fetch_add(1);
  } else if (!victim.closed() && victim.resident()) {
    OffloadWithCredit(victim, stream, OffloadCause::kEviction, host_credit);
  }
  return true;  // room was made, or the session left the device meanwhile
}

void Residency::NotifyIdle() {
  if (capacity_waiters_.load(std::memory_order_relaxed) > 0) {
    // Taking the lock orders the notification after a waiter's check.
    { MutexLock lock(registry_mutex_); }
    capacity_cv_.notify_all();
  }
}

}  // namespace aoti_sessions
