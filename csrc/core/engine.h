// The engine: one compiled model (one or more methods) loaded once, serving
// any number of isolated sessions. A thin facade over its rooms:
//
//   Engine (facade)  ->  Session (public session operations)
//                           |-> Runner        the run path: lanes, bind, run, weight updates
//                           |     '-> GraphSet  per-session CUDA graphs and their pools
//                           |-> Residency     registry, budgets, tiers, eviction, idle reaper
//                           |-> StateStore    where state is kept, chosen once in Create: a
//                           |                 BlockStore, or a PoolStore (and its PoolLease)
//                           |-> SessionFiles  fingerprint, save, load
//                           '-> SessionState  one session's block, tier, bind key, lock
//   Residency -> StateStore -> SessionFiles;  Runner, Residency, StateStore, SessionFiles -> Model
//   Model -> Container, WeightStore, Device;  everything -> options.h (public value types)
//
// Nothing includes a room above it.
//
// Locking
// -------
// The locks, in the order a thread may take them (one lower in the list only
// while holding one higher, never the other way):
//   1. A session's lock (SessionState::mutex): held for the whole of one
//      operation on that session (a run included). A thread blocks on at most
//      one session's lock, holding no other lock: another session's lock is
//      only ever try-locked (eviction, idle expiry), so two calls never wait
//      on each other's sessions.
//   2. The weights lock (Runner::weights_mutex_), a reader-writer lock: every
//      run holds it shared; weight updates and Close hold it exclusively.
//      Under it, a run leases one lane (container) of its method for bind +
//      run (a container takes no lock of its own when rebinding); a graph
//      replay needs no lane.
//   3. The registry lock (Residency::registry_mutex_): the session registry
//      and the accounting of both tiers. Released before try-locking a
//      session, and never held across a device copy or a run.
//   4. Leaves, held for a few instructions with nothing taken under them: the
//      host pool's lock, a StreamTracker's lock, the idle reaper's lock, the
//      runner's lane lock (Runner::lanes_mutex_: lane fields and the stream
//      list; a run waiting for a free lane waits on it), the graph
//      tables' lock (GraphSet::mutex_) and a graph pool's replay lock
//      (GraphSet::PoolUse::replay_mutex: copies in, launch, copies out).
//   Between 2 and 3: GraphSet::capture_mutex_, held across a capture on the
//   device's shared capture stream (work of the legacy default stream); the
//   state pool's memory lock (StatePool::memory_mutex_, state_pool.h; the
//   pool store's, which takes no lock of its own: a PoolLease reserves room
//   with the registry lock after the pool's locks are released); and
//   the CUDA device's capture gate, held exclusively across any capture and
//   shared while two streams are ordered (an event on a stream another thread
//   captures would join its capture), with nothing taken under it.
//   A GraphHost (torch's allocator routing, the Python layer) is called with
//   locks 1, 2 and the capture lock held, never a leaf; it must not call into
//   the engine.
// Atomics read without a lock, each mirroring a field written under one:
// SessionState::closed_, resident_, last_use_ns_ (session lock);
// SessionState::waiting_for_room_ (set by the call that holds the session
// lock, while it waits for device room); Runner::closed_ (weights lock);
// Residency::capacity_waiters_ (threads waiting under the registry lock). The
// counters behind stats() mirror nothing.
// Names: a function that needs a lock says so with REQUIRES (checked by
// clang's -Wthread-safety build in tests/test_project.py); one that needs the
// weights lock or the registry lock also ends in Locked / RegistryLocked.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "device.h"
#include "graphs.h"
#include "options.h"
#include "session.h"
#include "torch_shim.h"

namespace aoti_sessions {

class Engine {
 public:
  // Checks the methods and options, loads every method, captures the
  // mutable-state descriptors and templates and fingerprints the model files,
  // before any run. Throws kPackage (unloadable or inconsistent model) or
  // kInvalidArgument (bad options); nothing stays allocated.
  // `graph_host` routes torch's allocations during CUDA graph captures
  // (graphs.h); without one, CUDA engines run eagerly.
  static std::shared_ptr<Engine> Create(const std::vector<MethodSource>& methods,
                                        const EngineOptions& options,
                                        std::shared_ptr<GraphHost> graph_host = nullptr);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const DeviceSpec& device() const;
  std::vector<std::string> method_names() const;
  // Index of a method by name; throws kInvalidArgument naming the methods.
  size_t method_index(const std::string& name) const;
  // The method's pytree call spec (in, out) as JSON, and its number of tensor
  // inputs. Throw kInvalidArgument for an unknown method index.
  const std::pair<std::string, std::string>& call_spec(size_t method) const;
  size_t num_inputs(size_t method) const;
  // Whether the method's runs are captured into CUDA graphs (so far: a
  // failed capture under cuda_graphs="auto" turns it off).
  bool captures(size_t method) const;
  const std::vector<MutableBuffer>& mutable_buffers() const;
  // Index of a mutable FQN; throws kInvalidArgument if it is not one.
  size_t buffer_index(const std::string& fqn) const;
  // Device bytes of one session's state (all buffers, aligned; 0 with pooled
  // state, whose sessions hold what their positions take: pool()).
  size_t bytes_per_session() const;
  // The pooled state every pooled method shares, if the model keeps one
  // (docs/batching.md).
  const std::optional<PoolLayout>& pool() const;
  // Bytes of weights held (each distinct weight once, whatever the methods).
  size_t weight_bytes() const;
  // Bytes of engine-owned template memory (zero initial values cost none).
  size_t template_bytes() const;
  std::vector<WeightInfo> weights() const;
  // What loading noticed and decided (e.g. weights kept apart because methods
  // disagree on them); the Python layer logs these.
  const std::vector<std::string>& load_notes() const;
  // Safe at any time, also during or after Close().
  MemoryReport memory_report() const;
  EngineStats stats() const;

  // See Runner::UpdateWeights.
  void UpdateWeights(const std::vector<WeightUpdate>& updates, bool double_buffer);

  // A new session, its state initialised from the templates. Throws kCapacity
  // (with the numbers) when max_sessions would be exceeded, or memory_budget
  // and no idle session can be offloaded.
  std::shared_ptr<Session> NewSession(StreamHandle stream = nullptr);
  // A new session with the state saved in a session file. The whole file is
  // checked (header, the engine's fingerprint, every buffer's checksum) before
  // a session is made: kFileNotFound, kSessionFile (truncated, corrupted, not
  // a session file, other format version) or kModelMismatch (other buffers,
  // or with `strict` other model files) leave the engine as it was. The
  // file's attachment (Session::Save) goes to `attachment`, if given: read
  // with the state, from the same file.
  std::shared_ptr<Session> LoadSession(const std::string& path, bool strict,
                                       StreamHandle stream = nullptr,
                                       std::string* attachment = nullptr);

  // Runs pooled `method` once over `rows`, sessions of this engine: see
  // Session::RunBatch.
  std::vector<OwnedTensor> RunBatch(const std::vector<std::shared_ptr<Session>>& rows,
                                    size_t method, std::vector<OwnedTensor>&& inputs,
                                    StreamHandle stream = nullptr);

  // Closes every session (waiting for their runs) and releases the method
  // containers. Later calls on the engine or its sessions throw kSessionClosed.
  void Close();
  bool closed() const;

 private:
  explicit Engine(std::shared_ptr<const EngineParts> parts) : parts_(std::move(parts)) {}
  std::shared_ptr<const EngineParts> parts_;
};

}  // namespace aoti_sessions
