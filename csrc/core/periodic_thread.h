// A background thread that calls a function periodically: the idle reaper of
// the residency. Its state is shared with the thread, so the owner may be
// destroyed on the thread itself (the function can drop the last reference to
// its owner): stopping from the thread detaches instead of joining.
#pragma once

#include <chrono>
#include <functional>
#include <memory>

namespace aoti_sessions {

class PeriodicThread {
 public:
  // Calls `tick` every `period` until stopped or until `tick` returns false.
  // Exceptions from `tick` are dropped (the next period tries again).
  PeriodicThread(std::chrono::duration<double> period, std::function<bool()> tick);
  ~PeriodicThread() { Stop(); }
  PeriodicThread(const PeriodicThread&) = delete;
  PeriodicThread& operator=(const PeriodicThread&) = delete;

  // Stops the thread and waits for it (safe to call from several threads at
  // once, and from the thread itself).
  void Stop() noexcept;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace aoti_sessions
