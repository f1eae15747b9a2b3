// The ELF pre-check of model libraries: headers, PT_LOAD bounds, DT_NEEDED.
#include "elf_check.h"

#include <elf.h>
#include <fcntl.h>
#include <sys/stat.h>

#include <cstring>

#include "posix_file.h"

namespace aoti_sessions {
namespace {

class ElfFile {
 public:
  explicit ElfFile(const std::string& path) : fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {
    struct stat st {};
    if (fd_.valid() && ::fstat(fd_.get(), &st) == 0) size_ = static_cast<uint64_t>(st.st_size);
  }
  bool open() const { return fd_.valid(); }
  // Whether [offset, offset + bytes) lies inside the file.
  bool Contains(uint64_t offset, uint64_t bytes) const {
    return offset <= size_ && bytes <= size_ - offset;
  }
  // Reads exactly `bytes` at `offset`; false if they are not all in the file.
  bool Read(uint64_t offset, uint64_t bytes, void* out) const {
    return Contains(offset, bytes) &&
           ReadAt(fd_.get(), out, bytes, offset) == static_cast<int64_t>(bytes);
  }

 private:
  FileDescriptor fd_;
  uint64_t size_ = 0;
};

}  // namespace

ElfInfo ReadElf(const std::string& path) {
  ElfInfo info;
  ElfFile file(path);
  if (!file.open()) return info;
  Elf64_Ehdr header;
  if (!file.Read(0, sizeof(header), &header) ||
      std::memcmp(header.e_ident, ELFMAG, SELFMAG) != 0 || header.e_ident[EI_CLASS] != ELFCLASS64) {
    return info;
  }
  info.elf64 = true;
  for (uint64_t i = 0; i < header.e_phnum; ++i) {
    Elf64_Phdr segment;
    if (!file.Read(header.e_phoff + i * sizeof(Elf64_Phdr), sizeof(segment), &segment) ||
        (segment.p_type == PT_LOAD && !file.Contains(segment.p_offset, segment.p_filesz))) {
      info.complete = false;
      return info;
    }
  }
  auto section = [&](uint64_t index, Elf64_Shdr* out) {
    return index < header.e_shnum &&
           file.Read(header.e_shoff + index * sizeof(Elf64_Shdr), sizeof(Elf64_Shdr), out);
  };
  for (uint64_t i = 0; i < header.e_shnum; ++i) {
    Elf64_Shdr dynamic, strtab;
    if (!section(i, &dynamic)) break;
    if (dynamic.sh_type != SHT_DYNAMIC || !section(dynamic.sh_link, &strtab)) continue;
    // Sizes come from the file: bound them by it before allocating.
    if (!file.Contains(strtab.sh_offset, strtab.sh_size) ||
        !file.Contains(dynamic.sh_offset, dynamic.sh_size)) {
      info.complete = false;
      return info;
    }
    std::vector<char> strings(strtab.sh_size);
    std::vector<Elf64_Dyn> entries(dynamic.sh_size / sizeof(Elf64_Dyn));
    if (!file.Read(strtab.sh_offset, strings.size(), strings.data()) ||
        !file.Read(dynamic.sh_offset, entries.size() * sizeof(Elf64_Dyn), entries.data())) {
      info.complete = false;
      return info;
    }
    for (const Elf64_Dyn& entry : entries) {
      if (entry.d_tag == DT_NULL) break;
      if (entry.d_tag == DT_NEEDED && entry.d_un.d_val < strings.size()) {
        const char* name = strings.data() + entry.d_un.d_val;
        info.needed.emplace_back(name, strnlen(name, strings.size() - entry.d_un.d_val));
      }
    }
  }
  return info;
}

}  // namespace aoti_sessions
