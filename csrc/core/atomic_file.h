// Writing a file atomically: the bytes go to a temporary file beside the
// target, which is fsynced and renamed over it, then the folder is fsynced.
// Readers see the old file or the whole new one, never a part. A writer killed
// mid-way (kill -9) leaves its temporary file behind; the next writer into the
// same folder removes such orphans. A temporary file is locked (flock) while
// its writer lives, so only the files of dead writers are ever removed,
// whatever process or pid namespace wrote them, and only files that begin with
// the writer's magic bytes (or are empty), under a hidden name no user would
// choose (".<target>.aoti-tmp-<pid>-<n>").
#pragma once

#include <cstddef>
#include <string>

#include "errors.h"
#include "posix_file.h"

namespace aoti_sessions {

class AtomicFileWriter {
 public:
  // Refuses a target that exists and is not a regular file (a folder, device,
  // FIFO or socket is never replaced), removes orphaned temporary files of
  // dead writers in the target's folder, and creates this writer's temporary
  // file. `magic`: the bytes every file of this kind starts with (the first
  // Write must begin with them). Failures throw `kind`, naming the path and
  // the step.
  AtomicFileWriter(const std::string& path, const std::string& magic, ErrorKind kind);
  // Removes the temporary file unless Commit() succeeded.
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void Write(const void* data, size_t bytes);
  // fsync, rename over the target, fsync of the folder.
  void Commit();

  // Whether `name` has the form of a temporary file (".<target>.aoti-tmp-<pid>-<n>").
  static bool IsTemporaryName(const std::string& name);

 private:
  [[noreturn]] void Fail(const std::string& what, int err) const;

  std::string path_;
  std::string tmp_;
  ErrorKind kind_;
  FileDescriptor fd_;
  bool committed_ = false;
};

}  // namespace aoti_sessions
