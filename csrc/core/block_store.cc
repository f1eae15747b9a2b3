// The block store: a session's state in a device block of its own.
#include "block_store.h"

#include "errors.h"

namespace aoti_sessions {

BlockStore::BlockStore(std::shared_ptr<Model> model)
    : model_(std::move(model)),
      device_(model_->device()),
      bytes_(model_->block_bytes()),
      host_pool_(model_->device(), model_->block_bytes()) {}

StateStore::Source BlockStore::From(const SessionState& state) const {
  Source source;
  source.initial = false;
  source.memory = state.memory();
  source.on_host = !state.resident();  // the host block may move once unlocked
  return source;
}

int64_t BlockStore::BytesOf(const Source&) const { return static_cast<int64_t>(bytes_); }

void BlockStore::Fill(SessionState& made, const Source& source, StreamHandle stream) {
  if (source.initial) {
    model_->InitializeBlock(made.device_block(), stream);
    return;
  }
  if (bytes_ > 0) device_.Copy(made.device_block(), source.memory, bytes_, stream);
  if (source.on_host) device_.Synchronize(stream);
}

void BlockStore::Reset(SessionState& state, DeviceRoom&, StreamHandle stream) {
  model_->InitializeBlock(state.device_block(), stream);
}

void* BlockStore::ToHost(SessionState& state, StreamHandle stream) {
  HostBlock block(host_pool_);
  if (bytes_ > 0) {
    device_.Copy(block.get(), state.device_block(), bytes_, stream);
    device_.Synchronize(stream);
  }
  return block.release();
}

void* BlockStore::ToDevice(SessionState& state, StreamHandle stream) {
  if (bytes_ == 0) return nullptr;
  void* block = device_.Allocate(bytes_, stream);
  try {
    device_.Copy(block, state.memory(), bytes_, stream);
    device_.Synchronize(stream);  // the host block goes back to the pool right after
  } catch (...) {
    try {
      device_.Free(block, stream);
    } catch (...) {
    }
    throw;
  }
  return block;
}

HostCopy BlockStore::NewHostCopy() {
  HostCopy copy;
  copy.block = std::make_unique<HostBlock>(host_pool_);
  copy.bytes = bytes_;
  return copy;
}

void BlockStore::CopyOut(SessionState& state, HostCopy& copy, StreamHandle stream) {
  state.Use(device_, stream);
  if (bytes_ == 0) return;
  device_.Copy(copy.block->get(), state.memory(), bytes_, stream);
  device_.Synchronize(stream);
}

SessionFiles::CheckedFile BlockStore::CheckFile(const SessionFiles& files, const std::string& path,
                                                bool strict) const {
  return files.CheckBlock(path, strict);
}

HostCopy BlockStore::ReadFile(const SessionFiles& files, SessionFiles::CheckedFile& file) {
  HostCopy copy = NewHostCopy();
  files.Read(file, copy.block->get());
  return copy;
}

void BlockStore::WriteFile(SessionFiles& files, const std::string& path, const HostCopy& copy,
                           const std::string& attachment) const {
  files.Save(path, copy.data(), attachment);
}

PoolStore& BlockStore::Pooled(const std::string& refusal) {
  Throw(ErrorKind::kInvalidArgument, refusal);
}

}  // namespace aoti_sessions
