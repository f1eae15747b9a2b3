// The block store: each session's state in one device block of its own
// (every mutable buffer, laid out by the model), offloaded to a host block of
// the same size, saved and loaded buffer by buffer (session file version 1).
#pragma once

#include <memory>

#include "model.h"
#include "state_store.h"

namespace aoti_sessions {

class BlockStore final : public StateStore {
 public:
  explicit BlockStore(std::shared_ptr<Model> model);

  Source From(const SessionState& state) const override REQUIRES(state.mutex());
  int64_t BytesOf(const Source& source) const override;
  void Fill(SessionState& made, const Source& source, StreamHandle stream) override
      REQUIRES(made.mutex());
  void Reset(SessionState& state, DeviceRoom& room, StreamHandle stream) override
      REQUIRES(state.mutex());

  // A block keeps nothing on the device only.
  void DropDeviceOnly([[maybe_unused]] SessionState& state, DeviceRoom&, StreamHandle) override
      REQUIRES(state.mutex()) {}
  void* ToHost(SessionState& state, StreamHandle stream) override REQUIRES(state.mutex());
  void* ToDevice(SessionState& state, StreamHandle stream) override REQUIRES(state.mutex());
  void FreeHost(void* host) override { host_pool_.Give(host); }
  // (The residency frees the device block.)
  void Release([[maybe_unused]] SessionState& state, void* host, StreamHandle) override
      REQUIRES(state.mutex()) {
    host_pool_.Give(host);
  }

  HostCopy NewHostCopy() override;
  void CopyOut(SessionState& state, HostCopy& copy, StreamHandle stream) override
      REQUIRES(state.mutex());
  SessionFiles::CheckedFile CheckFile(const SessionFiles& files, const std::string& path,
                                      bool strict) const override;
  HostCopy ReadFile(const SessionFiles& files, SessionFiles::CheckedFile& file) override;
  void WriteFile(SessionFiles& files, const std::string& path, const HostCopy& copy,
                 const std::string& attachment) const override;

  PoolStore& Pooled(const std::string& refusal) override;
  size_t allocated_bytes() const override { return 0; }
  size_t host_spare_bytes() const override { return host_pool_.spare_bytes(); }
  void AddStats(EngineStats&) const override {}

 private:
  const std::shared_ptr<Model> model_;
  Device& device_;
  const size_t bytes_;  // of a block
  HostPool host_pool_;  // host blocks (offloaded sessions, copies)
};

}  // namespace aoti_sessions
