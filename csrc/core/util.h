// Small helpers every component uses: alignment, bounded lists of names in
// messages, the steady clock, path checks, and the process a component was made in.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace aoti_sessions {

// `n` rounded up to a multiple of `alignment` (a power of two or not).
inline size_t AlignUp(size_t n, size_t alignment) {
  return (n + alignment - 1) / alignment * alignment;
}

// "a, b, c" for messages; at most `limit` names, then "and N more", so that a
// hostile input (a file listing 60,000 methods) cannot make a huge message.
// "none" for an empty list.
std::string JoinNames(const std::vector<std::string>& names, size_t limit = 8);

// "1200 bytes".
inline std::string BytesText(int64_t n) { return std::to_string(n) + " bytes"; }

// Nanoseconds of the steady clock (CLOCK_MONOTONIC).
int64_t SteadyNowNs();

// Throws kInvalidArgument when `path` holds a NUL byte (the OS would silently
// cut it there), as Python's open() does; `what` names the argument.
void RequireValidPath(const std::string& path, const char* what);

// Which process image this is: changes in the child of every fork(). A
// component remembers it when made and refuses to run in another one (the
// child has none of the parent's threads, and locks they held stay locked).
uint64_t ProcessGeneration();

}  // namespace aoti_sessions
