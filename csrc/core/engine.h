// The engine: one compiled model (one or more methods) loaded once, with the
// descriptors and templates of its mutable state, serving any number of
// isolated sessions. Weights are held by the method containers; every session
// owns one block of device memory holding all its mutable buffers.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "container.h"
#include "device.h"
#include "torch_shim.h"

namespace aoti_sessions {

class Session;

// What one input of a method must look like. Unknown for packages that carry no
// aoti_sessions metadata; the container's own checks then apply.
struct InputSpec {
  int32_t dtype = 0;
  std::vector<int64_t> sizes;    // -1 for a dynamic dimension
  std::vector<int64_t> strides;  // expected strides; empty: contiguous
};

// A method to load: a model library and how to call it.
struct MethodSource {
  std::string name;
  std::string library_path;
  std::string cubin_dir;  // folder of the library's kernel files ("" if none)
  std::optional<std::vector<InputSpec>> inputs;
};

struct EngineOptions {
  std::string device = "cpu";
  // Mutable state: FQNs or fnmatch patterns; nullopt selects every Buffer-typed
  // constant of every method.
  std::optional<std::vector<std::string>> mutable_patterns;
  // FQNs the exported program is known to mutate; each must be in the selected
  // set, so that no mutated buffer is ever shared between sessions.
  std::vector<std::string> known_mutated;
  int64_t max_sessions = -1;   // -1: unlimited
  int64_t memory_budget = -1;  // bytes of session state; -1: unlimited
  // Delete the handle torch leaks on every user-managed bind. Right for every
  // torch released up to 2.14.1; must be false on a torch that frees those
  // handles itself (pytorch PR #194480), or binds double free. The Python
  // layer decides by torch version.
  bool reclaim_bind_handles = true;
};

// One mutable FQN: its layout, where it sits in a session block, its template.
struct MutableBuffer {
  std::string fqn;
  TensorLayout layout;
  size_t bytes = 0;         // span of the layout
  size_t offset = 0;        // offset inside a session block
  bool zero_initial = false;  // initial value all zero: memset, no template bytes
  std::vector<std::string> methods;  // methods that have this FQN
};

struct EngineStats {
  int64_t live_sessions = 0;
  int64_t live_bytes = 0;
  int64_t sessions_created = 0;
  int64_t runs = 0;
  int64_t binds = 0;
  int64_t bind_nanoseconds = 0;     // rebinding the containers (on the run path)
  int64_t reclaim_nanoseconds = 0;  // deleting handles torch leaked (after runs)
};

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  // Loads every method, captures mutable-state descriptors and templates before
  // any run. Throws kPackage (unloadable or inconsistent model) or
  // kInvalidArgument (bad options); nothing stays allocated.
  static std::shared_ptr<Engine> Create(const std::vector<MethodSource>& methods,
                                        const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const DeviceSpec& device() const { return device_->spec(); }
  std::vector<std::string> method_names() const;
  // Index of a method by name; throws kInvalidArgument naming the methods.
  size_t method_index(const std::string& name) const;
  // The method's pytree call spec (in, out) as JSON, and its number of tensor
  // inputs. Throw kInvalidArgument for an unknown method index.
  const std::pair<std::string, std::string>& call_spec(size_t method) const;
  size_t num_inputs(size_t method) const;
  const std::vector<MutableBuffer>& mutable_buffers() const { return buffers_; }
  // Index of a mutable FQN; throws kInvalidArgument if it is not one.
  size_t buffer_index(const std::string& fqn) const;
  // Device bytes of one session's state (all buffers, aligned).
  size_t bytes_per_session() const { return block_bytes_; }
  // Bytes of non-mutable constants held by the method containers.
  size_t weight_bytes() const { return weight_bytes_; }
  // Bytes of engine-owned template memory (zero initial values cost none).
  size_t template_bytes() const { return template_bytes_; }
  EngineStats stats() const;

  // A new session, its state initialised from the templates. Throws kCapacity
  // (with the numbers) when max_sessions or memory_budget would be exceeded.
  std::shared_ptr<Session> NewSession(StreamHandle stream = nullptr);

  // Closes every session (waiting for their runs) and releases the model.
  // Later calls on the engine or its sessions throw kSessionClosed.
  void Close();
  bool closed() const;

 private:
  friend class Session;
  struct Method {
    std::string name;
    std::unique_ptr<Container> container;
    std::optional<std::vector<InputSpec>> inputs;
    std::pair<std::string, std::string> call_spec;  // copied at load: outlives the container
    size_t num_inputs = 0;
    // (buffer index, internal constant name) for every mutable FQN it has.
    std::vector<std::pair<size_t, std::string>> bindings;
    uint64_t bound_session = 0;  // session id whose buffers are bound; 0: none
  };

  Engine() = default;
  // NewSession; the state is a copy of the block at `copy_from` if given (a
  // fork), else the templates. Registered only once complete.
  std::shared_ptr<Session> CreateSession(StreamHandle stream, const void* copy_from);
  void Load(const std::vector<MethodSource>& sources, const EngineOptions& options);
  void SelectMutable(const EngineOptions& options);
  void CaptureTemplates();
  // Checks inputs against the method (count, device, and the recorded specs);
  // may replace an input by a view with the exact strides the model expects.
  void ValidateInputs(const Method& method, std::vector<OwnedTensor>& inputs) const;
  const Method& MethodAt(size_t method) const;

  // Session-facing operations; the caller holds the session's lock.
  std::vector<OwnedTensor> RunLocked(Session& session, size_t method,
                                     std::vector<OwnedTensor>&& inputs, StreamHandle stream);
  void InitializeBlock(void* block, StreamHandle stream);
  void ReleaseSession(Session& session);
  void Forget(uint64_t session_id);

  std::unique_ptr<Device> device_;
  std::vector<Method> methods_;
  std::vector<MutableBuffer> buffers_;
  std::unordered_map<std::string, size_t> buffer_index_;
  size_t block_bytes_ = 0;
  size_t weight_bytes_ = 0;
  size_t template_bytes_ = 0;
  // Templates of the buffers whose initial value is not all zero, laid out as in
  // a session block; buffers are ordered so they form one prefix of the block.
  void* template_block_ = nullptr;
  StreamTracker template_stream_;  // streams that copied from the templates
  size_t nonzero_prefix_bytes_ = 0;
  EngineOptions options_;

  // Serialises bind + run on the containers (they take no lock when rebinding).
  std::mutex run_mutex_;
  // Guards the session registry and the capacity counters below.
  mutable std::mutex sessions_mutex_;
  std::unordered_map<uint64_t, std::weak_ptr<Session>> sessions_;
  uint64_t next_session_id_ = 1;
  // Tells the device how much freed memory to keep; sessions_mutex_ held.
  void RetainLocked();
  int64_t live_sessions_ = 0;
  int64_t live_bytes_ = 0;
  int64_t sessions_created_ = 0;
  bool closed_ = false;

  std::atomic<int64_t> runs_{0};
  std::atomic<int64_t> binds_{0};
  std::atomic<int64_t> bind_nanoseconds_{0};
  std::atomic<int64_t> reclaim_nanoseconds_{0};
};

}  // namespace aoti_sessions
