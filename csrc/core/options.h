// Public value types of the C++ API: what goes into an engine (methods to load,
// options, weight updates) and what comes out of it (descriptors, statistics,
// the memory report). Each rule on these values is checked here, once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "proxy_executor.h"
#include "torch_shim.h"

namespace aoti_sessions {

// What one input of a method must look like. Unknown for packages that carry no
// aoti_sessions metadata; the container's own checks then apply.
struct InputSpec {
  int32_t dtype = 0;
  std::vector<int64_t> sizes;    // -1 for a dynamic dimension
  std::vector<int64_t> strides;  // expected strides; empty: contiguous
};

// One tensor in a weights file (written by ais.compile): its bytes are the
// storage span of `layout`, at `offset`.
struct WeightEntry {
  std::string fqn;
  TensorLayout layout;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// A weights file and the entries one method reads from it.
struct WeightsFile {
  std::string path;
  std::vector<WeightEntry> entries;
};

// Pooled state (docs/batching.md): tensors that are inputs of the methods,
// allocated once by the engine and passed to every run, each session owning
// pages (one per `page_size` positions it holds) or one slot of them.
enum class PoolKind { kPages, kSlots };

// One input of a method that is a pooled tensor: `[units, ...]`.
struct PooledInput {
  size_t input = 0;
  std::string name;  // the pooled tensor it is: the same name in every method
  PoolKind kind = PoolKind::kPages;
};

// How a method addresses the pooled state: which of its inputs the engine
// fills (input positions). The caller gives the others, each with the rows
// (one per session) first.
struct PoolSource {
  int64_t page_size = 0;  // positions per page (with page tensors)
  std::vector<PooledInput> tensors;
  std::optional<size_t> page_table;  // int32 [rows, width] (with page tensors)
  // Pages a session holds at most: the page table's width when it is static;
  // with a dynamic width (a method without graphs) its bound, and each run
  // passes the width its rows need.
  int64_t max_pages = 0;
  std::optional<size_t> positions;   // int64 [rows]: positions each row held before the call
  std::optional<size_t> slot_ids;    // int32 [rows] (with slot tensors)
  size_t tokens = 0;                 // the caller's [rows, T, ...]: T new positions per row
  int64_t max_rows = 1;              // rows of one call at most
  // Rows of one call at least (a model compiled for two or more): a call of
  // fewer gets padding rows, as a graph bucket's do.
  int64_t min_rows = 1;

  // The structural rules on one method's pool against its recorded input
  // `specs` (docs/batching.md); the rules across methods (one layout for every
  // pooled tensor) are the model's. Throws kPackage naming `method`.
  void Validate(const std::optional<std::vector<InputSpec>>& specs,
                const std::string& method) const;
};

// A method to load: a model library and how to call it.
struct MethodSource {
  std::string name;
  std::string library_path;
  std::string cubin_dir;  // folder of the library's kernel files ("" if none)
  std::optional<std::vector<InputSpec>> inputs;
  // Where the method's weights are when its library was compiled without them.
  std::optional<WeightsFile> weights;
  // Set for a method over pooled state.
  std::optional<PoolSource> pool;
  // Runs the ops its library calls through the proxy executor (custom ops,
  // fallback kernels); null for a library that calls none.
  std::shared_ptr<ProxyExecutor> proxy;
};

// Throws kInvalidArgument (no methods, a name empty or given twice, a path
// with a NUL byte) or kPackage (an input spec whose strides and sizes differ
// in length; a pool that names inputs out of range, twice, or of the wrong
// dtype or rank), naming the method.
void ValidateSources(const std::vector<MethodSource>& methods);

// What an idle_timeout does to a session left idle that long.
enum class IdleAction { kOffload, kClose };

// Per-session CUDA graphs (see graphs.h). kAuto: capture where a method can be
// captured, run the rest eagerly (one note each saying why); kOn: as kAuto,
// but a method that cannot be captured raises; kOff: always eager.
enum class GraphMode { kAuto, kOn, kOff };

struct EngineOptions {
  std::string device = "cpu";
  // Mutable state: FQNs or fnmatch patterns; nullopt selects every Buffer-typed
  // constant of every method.
  std::optional<std::vector<std::string>> mutable_patterns;
  // FQNs the exported program is known to mutate; each must be in the selected
  // set, so that no mutated buffer is ever shared between sessions.
  std::vector<std::string> known_mutated;
  // Open sessions, resident and offloaded (nullopt: unlimited).
  std::optional<int64_t> max_sessions;
  // Bytes of session state in device memory (nullopt: unlimited). When a session
  // must be created or restored beyond it, the least recently used idle session
  // is offloaded to host memory first.
  std::optional<int64_t> memory_budget;
  // Bytes of offloaded session state in host memory (nullopt: unlimited; 0:
  // never offload, so a full memory_budget refuses new sessions).
  std::optional<int64_t> host_budget;
  // Sessions idle this many seconds get `idle_action` from a background thread
  // (nullopt: never).
  std::optional<double> idle_timeout_seconds;
  IdleAction idle_action = IdleAction::kOffload;
  // Delete the handle torch leaks on every user-managed bind. Right for every
  // torch released up to 2.14.1; must be false on a torch that frees those
  // handles itself (pytorch PR #194480), or binds double free
  // (docs/aoti-runtime.md). The Python layer decides by torch version.
  bool reclaim_bind_handles = true;
  // Refuse to load methods that disagree on a weight's layout or content (by
  // default both copies are kept, with a load note).
  bool strict_weights = false;
  // Containers per method ("lanes"), all sharing the held weights: a session
  // keeps the lane it last ran on bound to its state while the lane is not
  // needed by others (LRU), so switching between up to `lanes` hot sessions
  // binds nothing, and that many sessions run at once on different streams.
  // nullopt: kDefaultLanes (bench/RESULTS_graphs.md says what a lane costs).
  std::optional<int64_t> lanes;
  static constexpr int64_t kDefaultLanes = 4;
  static constexpr int64_t kMaxLanes = 64;
  GraphMode cuda_graphs = GraphMode::kAuto;
  // With CUDA graphs, hand out the graph's own output tensors (overwritten by
  // the session's next run of the method) instead of copies.
  bool graph_output_views = false;

  // Throws kInvalidArgument naming the first option out of range.
  void Validate() const;
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
  size_t bytes = 0;           // span of the layout
  size_t offset = 0;          // offset inside a session block
  bool zero_initial = false;  // initial value all zero: memset, no template bytes
  std::vector<std::string> methods;  // methods that have this FQN
};

// One weight held by the engine (each distinct weight once).
struct WeightInfo {
  std::string fqn;
  TensorLayout layout;
  size_t bytes = 0;
  std::vector<std::string> methods;  // methods bound to it
};

// Bytes by what holds them, on the engine's device.
struct MemoryReport {
  size_t weights = 0;     // held once, shared by every method
  size_t templates = 0;   // initial values that are not all zero
  size_t sessions = 0;    // session blocks
  size_t containers = 0;  // held by containers beyond shared weights, plus parking
  size_t pool = 0;        // pooled state allocated (in use by sessions: `sessions`)
  // Host memory: offloaded session state, and spare blocks kept for the next
  // offload or save (on a CPU engine both tiers are host memory).
  size_t offloaded = 0;
  size_t host_spare = 0;
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
  int64_t discards = 0;       // discardable sessions closed to make room or at idle_timeout
  int64_t restores = 0;
  int64_t saves = 0;
  int64_t loads = 0;
  std::vector<SessionStats> sessions;  // by id
  int64_t runs = 0;
  int64_t binds = 0;
  int64_t bind_nanoseconds = 0;     // rebinding the containers (on the run path)
  int64_t reclaim_nanoseconds = 0;  // deleting handles torch leaked (after runs)
  int64_t lanes = 0;                // containers per method
  int64_t graph_replays = 0;        // runs served by replaying a session's graph
  int64_t graph_captures = 0;
  int64_t graphs = 0;               // captured graphs alive now
  int64_t graph_pools = 0;          // activation pools (one per capture stream)
  // Pooled state (zero without it).
  int64_t pool_pages = 0;           // pages allocated (reserved ones included)
  int64_t pool_pages_used = 0;      // pages owned by sessions (shared ones once)
  int64_t pool_slots = 0;
  int64_t pool_slots_used = 0;
  int64_t pool_grows = 0;           // times the pool grew (each recaptures the graphs)
  int64_t pages_copied = 0;         // copy-on-write copies of a shared page
  int64_t batch_runs = 0;           // runs of a pooled method
  int64_t batch_rows = 0;           // sessions those runs stepped
  int64_t batch_nanoseconds = 0;    // in the core for them (rows, pages, the run)
};

}  // namespace aoti_sessions
