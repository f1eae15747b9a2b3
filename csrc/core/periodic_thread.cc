// The periodic background thread.
#include "periodic_thread.h"

#include <condition_variable>
#include <thread>

#include "mutex.h"

namespace aoti_sessions {

struct PeriodicThread::State {
  Mutex mutex;
  std::condition_variable_any cv;
  bool stop GUARDED_BY(mutex) = false;
  Mutex join_mutex;  // one stopper joins (concurrent stops may race)
  std::thread thread GUARDED_BY(join_mutex);
};

PeriodicThread::PeriodicThread(std::chrono::duration<double> period, std::function<bool()> tick)
    : state_(std::make_shared<State>()) {
  MutexLock join(state_->join_mutex);
  state_->thread = std::thread([state = state_, period, tick = std::move(tick)] {
    for (;;) {
      {
        MutexLock lock(state->mutex);
        if (!state->stop) lock.WaitFor(state->cv, period);
        if (state->stop) return;
      }
      try {
        if (!tick()) return;
      } catch (...) {
        // Best effort: the next period tries again.
      }
    }
  });
}

void PeriodicThread::Stop() noexcept {
  {
    MutexLock lock(state_->mutex);
    state_->stop = true;
  }
  state_->cv.notify_all();
  MutexLock join(state_->join_mutex);
  std::thread& thread = state_->thread;
  if (!thread.joinable()) return;
  if (thread.get_id() == std::this_thread::get_id()) {
    thread.detach();
  } else {
    thread.join();
  }
}

}  // namespace aoti_sessions
