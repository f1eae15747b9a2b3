// The engine: one compiled model (one or more methods) loaded once, with the
// descriptors and templates of its mutable state, serving any number of
// isolated sessions. Weights are held by the method containers; every session
// owns one block of device memory holding all its mutable buffers.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "checksum.h"
#include "container.h"
#include "device.h"
#include "state_file.h"
#include "torch_shim.h"
#include "weights.h"

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
  // Where the method's weights are when its library was compiled without them.
  std::optional<WeightsFile> weights;
};

struct EngineOptions {
  std::string device = "cpu";
  // Mutable state: FQNs or fnmatch patterns; nullopt selects every Buffer-typed
  // constant of every method.
  std::optional<std::vector<std::string>> mutable_patterns;
  // FQNs the exported program is known to mutate; each must be in the selected
  // set, so that no mutated buffer is ever shared between sessions.
  std::vector<std::string> known_mutated;
  int64_t max_sessions = -1;   // -1: unlimited (resident and offloaded sessions)
  // Bytes of session state in device memory; -1: unlimited. When a session
  // must be created or restored beyond it, the least recently used idle
  // session is offloaded to host memory first.
  int64_t memory_budget = -1;
  // Bytes of offloaded session state in host memory; -1: unlimited, 0: never
  // offload (a full memory_budget then refuses new sessions).
  int64_t host_budget = -1;
  // Sessions idle this long are offloaded (or closed, with idle_close) by a
  // background thread; 0: never.
  double idle_timeout_seconds = 0;
  bool idle_close = false;
  // Delete the handle torch leaks on every user-managed bind. Right for every
  // torch released up to 2.14.1; must be false on a torch that frees those
  // handles itself (pytorch PR #194480), or binds double free. The Python
  // layer decides by torch version.
  bool reclaim_bind_handles = true;
  // Refuse to load methods that disagree on a weight's layout or content (by
  // default both copies are kept, with a load note).
  bool strict_weights = false;
};

// Bytes by what holds them, on the engine's device.
struct MemoryReport {
  size_t weights = 0;     // held once, shared by every method
  size_t templates = 0;   // initial values that are not all zero
  size_t sessions = 0;    // session blocks
  size_t containers = 0;  // held by containers beyond shared weights, plus parking
  // Host memory: offloaded session state, and spare blocks kept for the next
  // offload or save (on a CPU engine both tiers are host memory).
  size_t offloaded = 0;
  size_t host_spare = 0;
};

// A new value for one weight: CPU memory with the held weight's layout.
struct WeightUpdate {
  std::string fqn;
  AtenTensorHandle source = nullptr;  // borrowed
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

struct SessionStats {
  uint64_t id = 0;
  bool resident = false;
  int64_t bytes = 0;
  int64_t last_use_ns = 0;  // steady clock (CLOCK_MONOTONIC)
};

struct EngineStats {
  int64_t live_sessions = 0;  // open sessions, resident or offloaded
  int64_t live_bytes = 0;     // their state, in both tiers
  int64_t resident_sessions = 0;
  int64_t offloaded_sessions = 0;
  int64_t device_bytes = 0;   // state of resident sessions (plus creations in flight)
  int64_t host_bytes = 0;     // state of offloaded sessions
  int64_t host_spare_bytes = 0;
  int64_t sessions_created = 0;
  int64_t offloads = 0;       // every move to host memory, whatever the cause
  int64_t evictions = 0;      // offloads to make room on the device
  int64_t idle_offloads = 0;  // offloads by idle_timeout
  int64_t idle_closes = 0;    // closes by idle_timeout
  int64_t restores = 0;
  int64_t saves = 0;
  int64_t loads = 0;
  std::vector<SessionStats> sessions;
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
  // Bytes of weights held (each distinct weight once, whatever the methods).
  size_t weight_bytes() const;
  MemoryReport memory_report() const;
  // What loading noticed and decided (e.g. weights kept apart because methods
  // disagree on them); the Python layer logs these.
  const std::vector<std::string>& load_notes() const { return load_notes_; }
  // Held weights: fqn, layout and the methods bound to each.
  const WeightStore& weights() const { return *weights_; }

  // Copies CPU tensors into the held weights. Every update is validated (known
  // weight, dtype, sizes, strides, CPU memory) before anything is written.
  // In place: waits for runs in flight and blocks new ones until done.
  // double_buffer: fills new memory while runs go on, then rebinds every
  // method to it at once (no run sees a mix) and frees the old memory after
  // the runs that used it.
  void UpdateWeights(const std::vector<WeightUpdate>& updates, bool double_buffer);
  // Bytes of engine-owned template memory (zero initial values cost none).
  size_t template_bytes() const { return template_bytes_; }
  EngineStats stats() const;

  // A new session, its state initialised from the templates. Throws kCapacity
  // (with the numbers) when max_sessions would be exceeded, or memory_budget
  // and no idle session can be offloaded.
  std::shared_ptr<Session> NewSession(StreamHandle stream = nullptr);
  // A new session with the state saved in a session file. The whole file is
  // checked (header, the engine's fingerprint, every buffer's checksum) before
  // a session is made: kFileNotFound, kSessionFile (truncated, corrupted, not
  // a session file, other format version) or kModelMismatch (other buffers,
  // or with `strict` other model files) leave the engine as it was.
  std::shared_ptr<Session> LoadSession(const std::string& path, bool strict,
                                       StreamHandle stream = nullptr);
  // What a session file records of this engine: per method its name and the
  // hashes of its library and weights file (computed once, on first use).
  const std::vector<StateFileMethod>& fingerprint();

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
    std::string library_path;
    uint64_t bound_key = 0;  // Session::bind_key_ of the bound buffers; 0: none
    std::optional<WeightsFile> weights_file;
    // (held weight, internal constant name) for every weight it reads.
    std::vector<std::pair<HeldWeight*, std::string>> weight_bindings;
    // Its own blob holds weights the engine adopted: never freed.
    bool keeps_own_constants = false;
  };
  // Initial value of a mutable constant, on the device or in host memory.
  struct InitialValue {
    TensorLayout layout;
    const void* data = nullptr;
  };

  Engine() = default;
  // NewSession; the state is a copy of the block at `copy_from` (device or,
  // with `from_host`, host memory) if given, else the templates. `held` is a
  // session whose lock the caller holds (never evicted meanwhile). Registered
  // only once complete.
  std::shared_ptr<Session> CreateSession(StreamHandle stream, const void* copy_from,
                                         bool from_host = false, const Session* held = nullptr);
  void Load(const std::vector<MethodSource>& sources, const EngineOptions& options);
  void SelectMutable(const EngineOptions& options);
  void CaptureTemplates();
  // Binds every method's weights to one held copy each (loading weights files,
  // adopting or copying embedded ones); called after SelectMutable.
  void HoldWeights();
  // After the templates are captured: releases the blobs of containers whose
  // weights are now shared, and the host copies of initial values.
  void FinishWeights();
  std::unordered_map<std::string, InitialValue> InitialValues(Method& method);
  // Records (or, with strict_weights, refuses) a weight that differs between methods.
  void NoteDifferingWeight(const Method& method, const std::string& fqn);
  // (internal name, held tensor) pairs of the method's weights, all or `only` those.
  std::vector<AOTInductorConstantMapEntry> WeightPairs(
      const Method& method, const std::unordered_set<const HeldWeight*>* only) const;
  // Blocks until the work queued by runs so far has finished; run_mutex_ held.
  void SyncRunStreams();
  // Checks inputs against the method (count, device, and the recorded specs);
  // may replace an input by a view with the exact strides the model expects.
  void ValidateInputs(const Method& method, std::vector<OwnedTensor>& inputs) const;
  const Method& MethodAt(size_t method) const;

  // Session-facing operations; the caller holds the session's lock.
  std::vector<OwnedTensor> RunLocked(Session& session, size_t method,
                                     std::vector<OwnedTensor>&& inputs, StreamHandle stream);
  void InitializeBlock(void* block, StreamHandle stream);
  void ReleaseSession(Session& session);
  void Forget(uint64_t session_id, bool resident);

  // ---- tiers (lifecycle.cc)
  enum class OffloadCause { kRequest, kEviction, kIdle };
  // A block of host memory for one session's state, from a small pool of
  // spare blocks (pinned allocations are slow); back to the pool when done.
  class HostBlock {
   public:
    explicit HostBlock(Engine& engine) : engine_(engine), ptr_(engine.TakeHostBlock()) {}
    ~HostBlock() { engine_.GiveHostBlock(ptr_); }
    HostBlock(const HostBlock&) = delete;
    HostBlock& operator=(const HostBlock&) = delete;
    void* get() const { return ptr_; }
    void* release() { return std::exchange(ptr_, nullptr); }

   private:
    Engine& engine_;
    void* ptr_;
  };
  void* TakeHostBlock();
  void GiveHostBlock(void* block) noexcept;
  // Bytes of the spare host blocks kept for reuse.
  size_t HostSpareBytes() const;
  // Moves the session's state to a host block; the caller holds its lock.
  // `host_credit`: host bytes the caller is about to release (a restore that
  // evicts: the swap leaves host use unchanged), allowed over host_budget.
  void OffloadLocked(Session& session, StreamHandle stream, OffloadCause cause,
                     int64_t host_credit = 0);
  // Brings it back, making room first; the caller holds its lock.
  void RestoreLocked(Session& session, StreamHandle stream);
  // Reserves device bytes for one session under memory_budget: offloads the
  // least recently used idle resident session (never `held`) while needed,
  // and waits for a session in use to finish when all are busy. Throws
  // kCapacity when room cannot be made.
  void ReserveDevice(const Session* held, StreamHandle stream);
  void UnreserveDevice();
  // Offloads `victim` if it is idle (its lock is free); false if it is busy.
  bool TryEvict(Session& victim, StreamHandle stream, int64_t host_credit);
  // Every registered session still alive; sessions_mutex_ held.
  std::vector<std::shared_ptr<Session>> OpenSessionsLocked() const;
  // A session operation ended: wake creators waiting for an idle session.
  void NotifyIdle();
  void WriteSessionFile(const std::string& path, const void* state);
  void StartReaper();
  void StopReaper() noexcept;
  void ExpireIdle();

  std::unique_ptr<Device> device_;
  std::vector<Method> methods_;
  std::vector<MutableBuffer> buffers_;
  std::unordered_map<std::string, size_t> buffer_index_;
  size_t block_bytes_ = 0;
  std::unique_ptr<WeightStore> weights_;
  std::vector<std::string> load_notes_;
  // Initial values of mutable constants read from weights files (load only).
  std::unordered_map<std::string, std::vector<char>> file_initial_;
  // Placeholder memory for the mutable constants of containers whose blob was
  // freed, until a session is bound (never read: runs bind a session first).
  void* parking_ = nullptr;
  size_t parking_bytes_ = 0;
  std::vector<OwnedTensor> parking_tensors_;
  std::vector<StreamHandle> run_streams_;  // streams runs were queued on; run_mutex_
  // Spare host blocks (each block_bytes_), under host_mutex_.
  mutable std::mutex host_mutex_;
  std::vector<void*> spare_host_;
  std::atomic<uint64_t> next_bind_key_{1};
  // Fingerprint for session files, computed on first use, of the model files
  // as they were at load (their stamps then).
  std::mutex fingerprint_mutex_;
  std::optional<std::vector<StateFileMethod>> fingerprint_;
  std::unordered_map<std::string, FileStamp> file_stamps_;
  // Creators waiting for a resident session to become idle.
  std::condition_variable capacity_cv_;
  std::atomic<int> capacity_waiters_{0};
  // The idle_timeout thread; its state outlives the engine (see StartReaper).
  struct Reaper;
  std::shared_ptr<Reaper> reaper_;
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
  int64_t device_bytes_ = 0;  // resident sessions, plus reservations in flight
  int64_t host_bytes_ = 0;    // offloaded sessions, plus reservations in flight
  int64_t offloaded_sessions_ = 0;
  int64_t sessions_created_ = 0;
  bool closed_ = false;
  std::atomic<int64_t> offloads_{0};
  std::atomic<int64_t> evictions_{0};
  std::atomic<int64_t> idle_offloads_{0};
  std::atomic<int64_t> idle_closes_{0};
  std::atomic<int64_t> restores_{0};
  std::atomic<int64_t> saves_{0};
  std::atomic<int64_t> loads_{0};

  std::atomic<int64_t> runs_{0};
  std::atomic<int64_t> binds_{0};
  std::atomic<int64_t> bind_nanoseconds_{0};
  std::atomic<int64_t> reclaim_nanoseconds_{0};
};

}  // namespace aoti_sessions
