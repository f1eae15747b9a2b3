// What the core reads of a model library before dlopen touches it: whether it
// is complete (dlopen maps a truncated library's missing pages and the process
// dies of SIGBUS on first touch) and which libraries it needs (CUDA or not).
#pragma once

#include <string>
#include <vector>

namespace aoti_sessions {

struct ElfInfo {
  bool elf64 = false;     // an ELF64 file (anything else is left to dlopen to refuse)
  bool complete = true;   // every loadable segment and section read lies inside the file
  std::vector<std::string> needed;  // DT_NEEDED entries
};

// Reads only the headers, the dynamic section and its string table (model
// libraries can embed gigabytes of weights). Every size the file claims is
// bounded by the file's own size before anything is allocated for it.
ElfInfo ReadElf(const std::string& path);

}  // namespace aoti_sessions
