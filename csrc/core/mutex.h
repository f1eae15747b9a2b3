// The core's mutex, annotated for clang's thread-safety analysis
// (-Wthread-safety, built by tests/test_project.py): members say which lock
// guards them (GUARDED_BY) and functions which lock they need (REQUIRES), and
// clang checks every access. Under other compilers the annotations vanish.
#pragma once

#include <condition_variable>
#include <mutex>
#include <shared_mutex>

#if defined(__clang__)
#define AIS_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define AIS_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) AIS_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY AIS_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) AIS_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) AIS_THREAD_ANNOTATION(pt_guarded_by(x))
#define REQUIRES(...) AIS_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define EXCLUDES(...) AIS_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ACQUIRE(...) AIS_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define ACQUIRE_SHARED(...) AIS_THREAD_ANNOTATION(acquire_shared_capability(__VA_ARGS__))
#define RELEASE_SHARED(...) AIS_THREAD_ANNOTATION(release_shared_capability(__VA_ARGS__))
#define REQUIRES_SHARED(...) AIS_THREAD_ANNOTATION(requires_shared_capability(__VA_ARGS__))
#define RELEASE(...) AIS_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) AIS_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define RETURN_CAPABILITY(x) AIS_THREAD_ANNOTATION(lock_returned(x))
#define ASSERT_CAPABILITY(x) AIS_THREAD_ANNOTATION(assert_capability(x))
#define NO_THREAD_SAFETY_ANALYSIS AIS_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace aoti_sessions {

class CAPABILITY("mutex") Mutex {
 public:
  void lock() ACQUIRE() { mutex_.lock(); }
  void unlock() RELEASE() { mutex_.unlock(); }
  bool try_lock() TRY_ACQUIRE(true) { return mutex_.try_lock(); }
  // Tells the analysis the calling thread holds this lock (taken where it
  // cannot see, say by the caller of a callback); checks nothing at run time.
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  std::mutex mutex_;
};

// Holds a Mutex for a scope.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mutex) ACQUIRE(mutex) : mutex_(mutex) { mutex_.lock(); }
  // Takes over a lock the caller already holds (say from a successful try_lock).
  struct Adopt {};
  MutexLock(Mutex& mutex, Adopt) REQUIRES(mutex) : mutex_(mutex) {}
  ~MutexLock() RELEASE() {
    if (held_) mutex_.unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;
  // Lets go early / takes it again (e.g. around work that must not run under it).
  void Unlock() RELEASE() {
    mutex_.unlock();
    held_ = false;
  }
  void Lock() ACQUIRE() {
    mutex_.lock();
    held_ = true;
  }
  // Waits on `cv` (the lock is released while waiting and held again after).
  template <typename Duration>
  void WaitFor(std::condition_variable_any& cv, Duration timeout) {
    cv.wait_for(mutex_, timeout);
  }

 private:
  Mutex& mutex_;
  bool held_ = true;
};

// A reader-writer lock: many holders in shared mode, or one in exclusive mode.
class CAPABILITY("shared_mutex") SharedMutex {
 public:
  void lock() ACQUIRE() { mutex_.lock(); }
  void unlock() RELEASE() { mutex_.unlock(); }
  void lock_shared() ACQUIRE_SHARED() { mutex_.lock_shared(); }
  void unlock_shared() RELEASE_SHARED() { mutex_.unlock_shared(); }

 private:
  std::shared_mutex mutex_;
};

// Holds a SharedMutex in shared mode for a scope.
class SCOPED_CAPABILITY ReaderLock {
 public:
  explicit ReaderLock(SharedMutex& mutex) ACQUIRE_SHARED(mutex) : mutex_(mutex) {
    mutex_.lock_shared();
  }
  ~ReaderLock() RELEASE() { mutex_.unlock_shared(); }
  ReaderLock(const ReaderLock&) = delete;
  ReaderLock& operator=(const ReaderLock&) = delete;

 private:
  SharedMutex& mutex_;
};

// Holds a SharedMutex in exclusive mode for a scope.
class SCOPED_CAPABILITY WriterLock {
 public:
  explicit WriterLock(SharedMutex& mutex) ACQUIRE(mutex) : mutex_(mutex) { mutex_.lock(); }
  ~WriterLock() RELEASE() { mutex_.unlock(); }
  WriterLock(const WriterLock&) = delete;
  WriterLock& operator=(const WriterLock&) = delete;

 private:
  SharedMutex& mutex_;
};

}  // namespace aoti_sessions
