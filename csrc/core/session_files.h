// Session files of one engine: the fingerprint of its model files, taken when
// they are loaded, and the checks that tie a file to the model on save and
// load. The file format itself is state_file.h.
#pragma once

#include <atomic>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "model.h"
#include "options.h"
#include "posix_file.h"
#include "state_file.h"

namespace aoti_sessions {

// What a session file records of an engine: per method its name and the
// hashes of its library and weights file. The files are opened before the
// model loads them and hashed on a background thread while it does, so the
// fingerprint is of the very files loaded: deleting, replacing or touching
// them afterwards changes nothing.
class ModelFingerprint {
 public:
  explicit ModelFingerprint(const std::vector<MethodSource>& sources);
  ~ModelFingerprint();  // waits for the hashing
  ModelFingerprint(const ModelFingerprint&) = delete;
  ModelFingerprint& operator=(const ModelFingerprint&) = delete;

  // Waits for the hashing. Throws kPackage if a file could not be read, or
  // is no longer the file opened (replaced while the model loaded).
  std::vector<StateFileMethod> Get();

 private:
  struct File {
    std::string path;
    FileDescriptor fd;
    int open_errno = 0;
    uint64_t device = 0, inode = 0;  // of the file opened
    uint64_t hash = 0;
    std::exception_ptr error;  // set by the hashing thread on failure
  };
  void Join();

  std::vector<File> files_;  // each distinct path once
  // Per method: name, index of its library and weights file in files_ (-1: none).
  struct Entry {
    std::string name;
    int library = -1;
    int weights = -1;
  };
  std::vector<Entry> methods_;
  std::atomic<bool> cancel_{false};  // a failed load does not wait for the hashing
  std::thread thread_;
};

class SessionFiles {
 public:
  SessionFiles(std::shared_ptr<Model> model, std::vector<StateFileMethod> fingerprint)
      : model_(std::move(model)), fingerprint_(std::move(fingerprint)) {}

  // Writes `state` (a host copy of a session block) and `attachment` (the
  // caller's bytes, kept with it: state_file.h) to a session file,
  // atomically. Throws kInvalidArgument (a NUL in the path, an attachment
  // over kMaxAttachment) or kSessionFile.
  void Save(const std::string& path, const void* state, const std::string& attachment);
  // Pooled state: writes `packed` (a host copy of a share of `pages` pages,
  // in StatePool's packed layout) and the session's length (format version 2).
  void SavePooled(const std::string& path, const void* packed, size_t pages, int64_t length,
                  const std::string& attachment);
  // A session file whose header was checked against this engine.
  struct CheckedFile {
    std::unique_ptr<StateFileReader> reader;
    std::vector<size_t> source;  // the file buffer of each engine buffer (or pooled tensor)
    int64_t positions = -1;      // pooled state: the session's length
    size_t pages = 0;            // pooled state: pages that length takes
    std::string attachment;      // what the saver attached (empty: nothing)
  };
  // Opens the file at `path` and checks its header: this engine's buffers
  // (block state) or pooled tensors and, with `strict`, its fingerprint.
  // Allocates nothing. Throws kInvalidArgument, kFileNotFound, kSessionFile or
  // kModelMismatch. The engine's state store calls the one of its kind.
  CheckedFile CheckBlock(const std::string& path, bool strict) const;
  CheckedFile CheckPooled(const std::string& path, bool strict) const;
  // Reads the file's state into `block`, a host block laid out as a session
  // block, checking every buffer's checksum (kSessionFile).
  void Read(CheckedFile& file, void* block) const;
  // Pooled state: reads the file's units into `packed` (the packed layout of
  // file.pages pages), checking every buffer's checksum.
  void ReadPooled(CheckedFile& file, void* packed) const;
  // Counts a load that became a session.
  void CountLoad() { loads_.fetch_add(1); }
  void AddStats(EngineStats& stats) const;

 private:
  // Opens the file (its path checked); `from` starts a mismatch's message.
  CheckedFile Open(const std::string& path, std::string* from) const;
  // The file buffer that feeds each engine buffer; throws kModelMismatch.
  std::vector<size_t> MatchBuffers(const StateFileHeader& header, const std::string& from) const;
  // The same for a pooled engine: the file buffer of each pooled tensor.
  std::vector<size_t> MatchPool(const StateFileHeader& header, const std::string& from) const;
  void MatchFingerprint(const StateFileHeader& header, const std::string& from) const;

  const std::shared_ptr<Model> model_;
  const std::vector<StateFileMethod> fingerprint_;
  std::atomic<int64_t> saves_{0};
  std::atomic<int64_t> loads_{0};
};

}  // namespace aoti_sessions
