// Small helpers every component uses.
#include "util.h"

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <mutex>

#include "errors.h"

namespace aoti_sessions {

std::string JoinNames(const std::vector<std::string>& names, size_t limit) {
  if (names.empty()) return "none";
  std::string out;
  for (size_t i = 0; i < names.size() && i < limit; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > limit) out += " and " + std::to_string(names.size() - limit) + " more";
  return out;
}

int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void RequireValidPath(const std::string& path, const char* what) {
  if (path.find('\0') != std::string::npos) {
    Throw(ErrorKind::kInvalidArgument, std::string(what) + ": embedded null byte");
  }
}

namespace {
std::atomic<uint64_t> generation{0};
void AfterForkInChild() { generation.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

uint64_t ProcessGeneration() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, AfterForkInChild); });
  return generation.load(std::memory_order_relaxed);
}

}  // namespace aoti_sessions
