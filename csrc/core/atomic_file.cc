// Atomic file writes: temporary file, fsync, rename, folder fsync, and the
// removal of temporary files that writers killed mid-way left behind.
#include "atomic_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

namespace aoti_sessions {
namespace {

// Temporary files are ".<target name>.aoti-tmp-<pid>-<n>": hidden, and named
// so that no user would choose the name.
constexpr char kTmpMark[] = ".aoti-tmp-";

std::string Folder(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// flock, retried when a signal interrupts it.
int Flock(int fd, int operation) {
  int rc;
  do {
    rc = ::flock(fd, operation);
  } while (rc != 0 && errno == EINTR);
  return rc;
}

// Removes the temporary file `name` in the open folder `dir` if no live writer
// holds its lock and it is one of ours. Best effort: anything unexpected
// leaves the file alone.
void RemoveIfOrphaned(int dir, const std::string& name, const std::string& magic) {
  FileDescriptor fd(::openat(dir, name.c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC));
  struct stat st {};
  if (!fd.valid() || ::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return;
  // A live writer holds an exclusive lock from creation to rename.
  if (Flock(fd.get(), LOCK_EX | LOCK_NB) != 0) return;
  std::string head(magic.size(), '\0');
  int64_t n = ReadAt(fd.get(), &head[0], head.size(), 0);
  // Ours: empty (a writer killed before its first write) or begins with the
  // magic bytes (the first write writes them whole).
  if (!(n == 0 || (n == static_cast<int64_t>(head.size()) && head == magic))) return;
  struct stat now {};
  if (::fstatat(dir, name.c_str(), &now, AT_SYMLINK_NOFOLLOW) != 0 || now.st_ino != st.st_ino ||
      now.st_dev != st.st_dev) {
    return;  // replaced meanwhile: not the file that was checked
  }
  ::unlinkat(dir, name.c_str(), 0);
}

void RemoveOrphans(const std::string& folder, const std::string& magic) {
  DIR* dir = ::opendir(folder.c_str());
  if (dir == nullptr) return;  // creating the temporary file will report why
  while (dirent* entry = ::readdir(dir)) {
    std::string name = entry->d_name;
    if (AtomicFileWriter::IsTemporaryName(name)) RemoveIfOrphaned(::dirfd(dir), name, magic);
  }
  ::closedir(dir);
}

}  // namespace

bool AtomicFileWriter::IsTemporaryName(const std::string& name) {
  // .<something>.aoti-tmp-<digits>-<digits>
  size_t mark = name.rfind(kTmpMark);
  if (name.empty() || name[0] != '.' || mark == std::string::npos || mark < 2) return false;
  std::string rest = name.substr(mark + sizeof(kTmpMark) - 1);
  size_t dash = rest.find('-');
  auto digits = [](const std::string& s) {
    return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos;
  };
  return dash != std::string::npos && digits(rest.substr(0, dash)) && digits(rest.substr(dash + 1));
}

AtomicFileWriter::AtomicFileWriter(const std::string& path, const std::string& magic,
                                   ErrorKind kind)
    : path_(path), kind_(kind) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) Throw(kind, path + " is a folder; cannot replace it with a file");
    if (!S_ISREG(st.st_mode)) {
      Throw(kind, path + " is not a regular file (a device, FIFO or socket); refusing to replace it");
    }
  }
  RemoveOrphans(Folder(path), magic);
  static std::atomic<uint64_t> counter{0};
  const size_t slash = path.rfind('/');
  const size_t name_at = slash == std::string::npos ? 0 : slash + 1;
  const std::string prefix = path.substr(0, name_at) + "." + path.substr(name_at) + kTmpMark +
                             std::to_string(::getpid()) + "-";
  for (;;) {
    tmp_ = prefix + std::to_string(counter.fetch_add(1));
    fd_ = FileDescriptor(::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (!fd_.valid() && errno == EEXIST) continue;  // the name of a writer elsewhere (another pid namespace)
    if (!fd_.valid()) Fail("cannot create a temporary file beside " + path, errno);
    if (Flock(fd_.get(), LOCK_EX) != 0) {
      int err = errno;
      ::unlink(tmp_.c_str());
      Fail("cannot lock " + tmp_, err);
    }
    // A cleaner may have taken the file between its creation and our lock.
    struct stat mine {};
    if (::fstat(fd_.get(), &mine) == 0 && mine.st_nlink > 0) break;
    fd_.Close();
  }
}

AtomicFileWriter::~AtomicFileWriter() {
  if (committed_) return;
  ::unlink(tmp_.c_str());  // still locked: no cleaner touches it meanwhile
  fd_.Close();
}

void AtomicFileWriter::Fail(const std::string& what, int err) const {
  Throw(kind_, what + ": " + ErrnoText(err));
}

void AtomicFileWriter::Write(const void* data, size_t bytes) {
  if (!WriteAll(fd_.get(), data, bytes)) Fail("writing " + tmp_ + " failed", errno);
}

void AtomicFileWriter::Commit() {
  if (::fsync(fd_.get()) != 0) Fail("fsync of " + tmp_ + " failed", errno);
  // Renamed while still locked: the name goes away with the lock held, so a
  // cleaner never sees this file unlocked under its temporary name.
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    Fail("renaming " + tmp_ + " to " + path_ + " failed", errno);
  }
  committed_ = true;
  fd_.Close();  // the data is durable already (fsync above)
  // Make the rename itself durable.
  FileDescriptor dir(::open(Folder(path_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir.valid()) ::fsync(dir.get());
}

}  // namespace aoti_sessions
