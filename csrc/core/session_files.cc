// The model fingerprint, and saving / checking / reading session files.
#include "session_files.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <set>
#include <unordered_map>

#include "checksum.h"
#include "errors.h"
#include "util.h"

namespace aoti_sessions {

namespace {

// A session file's path: not empty, no NUL byte (kInvalidArgument).
void CheckSessionPath(const std::string& path) {
  if (path.empty()) Throw(ErrorKind::kInvalidArgument, "the session file path is empty");
  RequireValidPath(path, "session file path");
}

}  // namespace

// ---------------------------------------------------------------- fingerprint

ModelFingerprint::ModelFingerprint(const std::vector<MethodSource>& sources) {
  std::unordered_map<std::string, int> index;  // a file shared by methods is read once
  auto open = [&](const std::string& path) {
    auto [it, added] = index.emplace(path, static_cast<int>(files_.size()));
    if (added) {
      File file;
      file.path = path;
      file.fd = FileDescriptor(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
      struct stat st {};
      if (!file.fd.valid() || ::fstat(file.fd.get(), &st) != 0) {
        file.open_errno = errno;
      } else {
        file.device = static_cast<uint64_t>(st.st_dev);
        file.inode = static_cast<uint64_t>(st.st_ino);
      }
      files_.push_back(std::move(file));
    }
    return it->second;
  };
  for (const MethodSource& source : sources) {
    methods_.push_back({source.name, open(source.library_path),
                        source.weights ? open(source.weights->path) : -1});
  }
  thread_ = std::thread([this] {
    for (File& file : files_) {
      if (!file.fd.valid()) continue;
      try {
        file.hash = HashFile(file.fd.get(), file.path, &cancel_);
      } catch (...) {
        file.error = std::current_exception();
      }
      file.fd.Close();
    }
  });
}

ModelFingerprint::~ModelFingerprint() {
  cancel_ = true;
  Join();
}

void ModelFingerprint::Join() {
  if (thread_.joinable()) thread_.join();
}

std::vector<StateFileMethod> ModelFingerprint::Get() {
  Join();
  auto hash = [&](int i) -> uint64_t {
    if (i < 0) return 0;
    const File& file = files_[static_cast<size_t>(i)];
    if (file.open_errno != 0) {
      Throw(ErrorKind::kPackage, "cannot read " + file.path + ": " + ErrnoText(file.open_errno));
    }
    if (file.error) std::rethrow_exception(file.error);
    // The model was loaded by path: it must still name the file hashed.
    struct stat st {};
    if (::stat(file.path.c_str(), &st) != 0 || static_cast<uint64_t>(st.st_dev) != file.device ||
        static_cast<uint64_t>(st.st_ino) != file.inode) {
      Throw(ErrorKind::kPackage, file.path + " was replaced or removed while the engine loaded it");
    }
    return file.hash;
  };
  std::vector<StateFileMethod> out;
  for (const Entry& m : methods_) out.push_back({m.name, hash(m.library), hash(m.weights)});
  return out;
}

// ---------------------------------------------------------------- files

void SessionFiles::Save(const std::string& path, const void* state, const std::string& attachment) {
  CheckSessionPath(path);
  StateFileHeader header;
  header.methods = fingerprint_;
  header.attachment = attachment;
  std::vector<const void*> data;
  for (const MutableBuffer& b : model_->buffers()) {
    StateFileBuffer entry;
    entry.fqn = b.fqn;
    entry.dtype = DtypeName(b.layout.dtype);
    entry.sizes = b.layout.sizes;
    entry.strides = b.layout.strides;
    entry.bytes = b.bytes;
    header.buffers.push_back(std::move(entry));
    data.push_back(static_cast<const char*>(state) + b.offset);
  }
  WriteStateFile(path, std::move(header), data);
  saves_.fetch_add(1);
}

void SessionFiles::SavePooled(const std::string& path, const void* packed, size_t pages,
                              int64_t length, const std::string& attachment) {
  CheckSessionPath(path);
  StateFileHeader header;
  header.methods = fingerprint_;
  header.attachment = attachment;
  header.positions = length;
  std::vector<const void*> data;
  const std::vector<size_t> offsets = model_->pool()->PackedOffsets(pages);
  const auto& tensors = model_->pool()->tensors;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorLayout layout = model_->pool()->SessionLayout(i, pages);
    StateFileBuffer entry;
    entry.fqn = tensors[i].name;
    entry.dtype = DtypeName(layout.dtype);
    entry.sizes = layout.sizes;
    entry.strides = layout.strides;
    entry.bytes = layout.span_bytes();
    header.buffers.push_back(std::move(entry));
    data.push_back(static_cast<const char*>(packed) + offsets[i]);
  }
  WriteStateFile(path, std::move(header), data);
  saves_.fetch_add(1);
}

std::vector<size_t> SessionFiles::MatchPool(const StateFileHeader& header,
                                            const std::string& from) const {
  const PoolLayout& pool = *model_->pool();
  std::vector<std::string> pooled;
  for (const PooledTensor& t : pool.tensors) pooled.push_back(t.name);
  if (header.positions < 0) {
    std::vector<std::string> theirs;
    for (const auto& b : header.buffers) theirs.push_back(b.fqn);
    Throw(ErrorKind::kModelMismatch,
          from + "it holds per-session buffers (" + JoinNames(theirs) +
              "), but this engine keeps its state pooled (" + JoinNames(pooled) +
              "): it was saved from a package made before pooled state; load it with that "
              "package, or start the session again on this one");
  }
  if (header.positions > pool.max_positions()) {
    Throw(ErrorKind::kModelMismatch, from + "it holds " + std::to_string(header.positions) +
                                         " positions; this engine's sessions hold at most " +
                                         std::to_string(pool.max_positions()));
  }
  const auto pages = static_cast<int64_t>(pool.PagesFor(header.positions));
  std::vector<size_t> source(pool.tensors.size(), SIZE_MAX);
  std::vector<std::string> unknown;
  for (size_t i = 0; i < header.buffers.size(); ++i) {
    const std::string& name = header.buffers[i].fqn;
    auto it = std::find(pooled.begin(), pooled.end(), name);
    if (it == pooled.end() || source[static_cast<size_t>(it - pooled.begin())] != SIZE_MAX) {
      unknown.push_back(name);
    } else {
      source[static_cast<size_t>(it - pooled.begin())] = i;
    }
  }
  std::vector<std::string> missing;
  for (size_t i = 0; i < pooled.size(); ++i) {
    if (source[i] == SIZE_MAX) missing.push_back(pooled[i]);
  }
  if (!unknown.empty() || !missing.empty()) {
    Throw(ErrorKind::kModelMismatch, from + "it has pooled tensors this engine lacks (" +
                                         JoinNames(unknown) + ") and lacks ones it has (" +
                                         JoinNames(missing) + ")");
  }
  for (size_t i = 0; i < pool.tensors.size(); ++i) {
    const PooledTensor& t = pool.tensors[i];
    const StateFileBuffer& got = header.buffers[source[i]];
    const TensorLayout want = pool.SessionLayout(i, static_cast<size_t>(pages));
    TensorLayout layout;
    layout.dtype = DtypeFromName(got.dtype);
    layout.sizes = got.sizes;
    layout.strides = got.strides;
    if (layout != want || got.bytes != want.span_bytes()) {
      Throw(ErrorKind::kModelMismatch, from + "pooled tensor '" + t.name + "' is " +
                                           layout.ToString() + " in the file but " +
                                           want.ToString() + " in this engine");
    }
  }
  return source;
}

std::vector<size_t> SessionFiles::MatchBuffers(const StateFileHeader& header,
                                               const std::string& from) const {
  if (header.positions >= 0) {
    Throw(ErrorKind::kModelMismatch,
          from + "it holds pooled state (" + std::to_string(header.positions) +
              " positions), but this engine keeps per-session buffers");
  }
  const auto& buffers = model_->buffers();
  std::vector<size_t> source(buffers.size(), SIZE_MAX);
  std::set<std::string> unknown, missing;
  for (size_t i = 0; i < header.buffers.size(); ++i) {
    const std::string& fqn = header.buffers[i].fqn;
    if (!model_->is_mutable(fqn) || source[model_->buffer_index(fqn)] != SIZE_MAX) {
      unknown.insert(fqn);
    } else {
      source[model_->buffer_index(fqn)] = i;
    }
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (source[i] == SIZE_MAX) missing.insert(buffers[i].fqn);
  }
  if (!unknown.empty() || !missing.empty()) {
    auto names = [](const std::set<std::string>& s) {
      return JoinNames(std::vector<std::string>(s.begin(), s.end()));
    };
    Throw(ErrorKind::kModelMismatch, from + "it has buffers this engine lacks (" + names(unknown) +
                                         ") and lacks buffers this engine has (" + names(missing) +
                                         ")");
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    const MutableBuffer& want = buffers[i];
    const StateFileBuffer& got = header.buffers[source[i]];
    TensorLayout layout;
    layout.dtype = DtypeFromName(got.dtype);
    layout.sizes = got.sizes;
    layout.strides = got.strides;
    // The byte count too: it sizes the read into the engine's buffer.
    if (layout != want.layout || got.bytes != want.bytes) {
      Throw(ErrorKind::kModelMismatch, from + "buffer '" + want.fqn + "' is " + layout.ToString() +
                                           " in the file but " + want.layout.ToString() +
                                           " in this engine");
    }
  }
  return source;
}

void SessionFiles::MatchFingerprint(const StateFileHeader& header, const std::string& from) const {
  std::set<std::string> theirs, mine;
  for (const auto& m : header.methods) theirs.insert(m.name);
  for (const auto& m : fingerprint_) mine.insert(m.name);
  const std::string relax = " (load_session(..., strict=False) accepts state whose buffers match)";
  if (theirs != mine) {
    Throw(ErrorKind::kModelMismatch,
          from + "its methods are (" + JoinNames({theirs.begin(), theirs.end()}) +
              "), this engine's are (" + JoinNames({mine.begin(), mine.end()}) + ")" + relax);
  }
  for (const auto& their : header.methods) {
    const auto& m = *std::find_if(fingerprint_.begin(), fingerprint_.end(),
                                  [&](const StateFileMethod& x) { return x.name == their.name; });
    if (their.library_hash != m.library_hash) {
      Throw(ErrorKind::kModelMismatch,
            from + "method '" + m.name + "' has another compiled library" + relax);
    }
    if (their.weights_hash != m.weights_hash) {
      Throw(ErrorKind::kModelMismatch, from + "method '" + m.name + "' has other weights" + relax);
    }
  }
}

SessionFiles::CheckedFile SessionFiles::Open(const std::string& path, std::string* from) const {
  CheckSessionPath(path);
  CheckedFile file;
  file.reader = std::make_unique<StateFileReader>(path);
  file.attachment = file.reader->header().attachment;
  *from = "session file " + path + " was saved from another model: ";
  return file;
}

SessionFiles::CheckedFile SessionFiles::CheckBlock(const std::string& path, bool strict) const {
  std::string from;
  CheckedFile file = Open(path, &from);
  const StateFileHeader& header = file.reader->header();
  file.source = MatchBuffers(header, from);
  if (strict) MatchFingerprint(header, from);
  return file;
}

SessionFiles::CheckedFile SessionFiles::CheckPooled(const std::string& path, bool strict) const {
  std::string from;
  CheckedFile file = Open(path, &from);
  const StateFileHeader& header = file.reader->header();
  file.source = MatchPool(header, from);
  file.positions = header.positions;
  file.pages = model_->pool()->PagesFor(header.positions);
  if (strict) MatchFingerprint(header, from);
  return file;
}

void SessionFiles::ReadPooled(CheckedFile& file, void* packed) const {
  const std::vector<size_t> offsets = model_->pool()->PackedOffsets(file.pages);
  for (size_t i = 0; i < offsets.size(); ++i) {
    file.reader->ReadBuffer(file.source[i], static_cast<char*>(packed) + offsets[i]);
  }
}

void SessionFiles::Read(CheckedFile& file, void* block) const {
  // Each buffer is read into place; only the alignment padding between them
  // is zeroed (a session block's padding is zero, as a fresh one's is).
  auto* base = static_cast<char*>(block);
  const auto& buffers = model_->buffers();
  std::vector<const MutableBuffer*> by_offset;
  for (const MutableBuffer& b : buffers) by_offset.push_back(&b);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const MutableBuffer* a, const MutableBuffer* b) { return a->offset < b->offset; });
  size_t end = 0;
  for (const MutableBuffer* b : by_offset) {
    std::memset(base + end, 0, b->offset - end);
    end = b->offset + b->bytes;
  }
  if (model_->block_bytes() > end) std::memset(base + end, 0, model_->block_bytes() - end);
  for (size_t i = 0; i < buffers.size(); ++i) {
    file.reader->ReadBuffer(file.source[i], base + buffers[i].offset);
  }
}

void SessionFiles::AddStats(EngineStats& s) const {
  s.saves = saves_.load();
  s.loads = loads_.load();
}

}  // namespace aoti_sessions
