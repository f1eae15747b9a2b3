// One compiled model library opened with dlopen, and the AOTInductor model
// containers created from it: the only place the core calls container entry
// points. Also owns the workaround for torch's user-managed bind handle leak
// (docs/aoti-runtime.md). A fallible call takes the ErrorKind its caller wants
// a failure reported as: the same bind is a package fault while loading and a
// run fault on the run path.
#pragma once

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "aoti_abi.h"
#include "device.h"
#include "errors.h"
#include "proxy_executor.h"
#include "torch_shim.h"

namespace aoti_sessions {

// A model library (`*.so`) and its resolved container entry points.
class ModelLibrary {
 public:
  // Opens the library; throws kPackage if it cannot be loaded or lacks a
  // required entry point (the message names it).
  static std::shared_ptr<ModelLibrary> Open(const std::string& path);
  ~ModelLibrary();
  ModelLibrary(const ModelLibrary&) = delete;
  ModelLibrary& operator=(const ModelLibrary&) = delete;

  const std::string& path() const { return path_; }
  // Whether the library links a CUDA runtime (read from its DT_NEEDED entries).
  bool targets_cuda() const { return targets_cuda_; }
  // The message of the last failed container call on this thread (torch >= 2.13),
  // or a pointer to stderr where older runtimes print it.
  std::string LastError() const;

  // Required entry points.
  abi::CreateWithDeviceFn create_with_device = nullptr;
  abi::DeleteFn destroy = nullptr;
  abi::RunFn run = nullptr;
  abi::RunFn run_single_threaded = nullptr;
  abi::GetCountFn num_constants = nullptr;
  abi::GetNameFn constant_name = nullptr;
  abi::GetNameFn constant_fqn = nullptr;
  abi::GetBoolFn constant_from_folded = nullptr;
  abi::GetInt32Fn constant_type = nullptr;
  abi::GetInt32Fn constant_dtype = nullptr;
  abi::GetSizeFn constant_data_size = nullptr;
  abi::GetCountFn num_inputs = nullptr;
  abi::GetNameFn input_name = nullptr;
  abi::GetCountFn num_outputs = nullptr;
  abi::GetNameFn output_name = nullptr;
  abi::GetCallSpecFn call_spec = nullptr;
  abi::UpdatePairsFn update_user_managed_pairs = nullptr;
  abi::HandleOnlyFn swap_constant_buffer = nullptr;
  abi::HandleOnlyFn free_inactive_constant_buffer = nullptr;
  // Optional entry points (nullptr where this torch lacks them); one of the two
  // extract functions is required.
  abi::ExtractEntriesFn extract_entries = nullptr;  // torch >= 2.13
  abi::ExtractMapFn extract_map = nullptr;          // older, std::unordered_map based
  abi::GetLastErrorFn last_error = nullptr;         // torch >= 2.13

 private:
  ModelLibrary() = default;
  std::string path_;
  void* handle_ = nullptr;
  bool targets_cuda_ = false;
};

// Static description of one container constant.
struct ConstantInfo {
  std::string name;  // internal name: the key of every bind
  std::string fqn;   // original FQN in the eager module
  abi::ConstantType type = abi::ConstantType::kUnknown;
  int32_t dtype = 0;
  size_t data_size = 0;
  bool from_folded = false;
};

// One AOTInductorModelContainer. Not thread-safe: callers serialise every call
// on it (the engine's runner holds its run lock; the container itself takes no
// lock when rebinding, docs/aoti-runtime.md). A failing constructor is kPackage
// and a failing Run kRun; the other calls fail with the kind they are given.
class Container {
 public:
  // `reclaim_bind_handles`: delete the tensor handle each user-managed bind
  // makes and torch never frees (torch <= 2.14). Must be false on a torch that
  // frees them itself, or binds double free.
  // `proxy`: runs the ops the library calls through the proxy executor (null: none).
  Container(std::shared_ptr<ModelLibrary> library, const DeviceSpec& device,
            const std::string& cubin_dir, bool reclaim_bind_handles,
            std::shared_ptr<ProxyExecutor> proxy = nullptr);
  ~Container();
  Container(const Container&) = delete;
  Container& operator=(const Container&) = delete;

  const ModelLibrary& library() const { return *library_; }
  const std::shared_ptr<ModelLibrary>& shared_library() const { return library_; }
  const std::vector<ConstantInfo>& constants() const { return constants_; }
  size_t num_inputs() const { return input_names_.size(); }
  size_t num_outputs() const { return num_outputs_; }
  const std::vector<std::string>& input_names() const { return input_names_; }
  const std::string& in_spec() const { return in_spec_; }
  const std::string& out_spec() const { return out_spec_; }

  // The tensors currently bound to each non-folded constant, by FQN. Borrowed:
  // valid until the next bind or run.
  std::unordered_map<std::string, AtenTensorHandle> CurrentConstants(ErrorKind kind);

  // Binds `pairs` (internal name -> caller-owned tensor) as user-managed
  // constants of the active set: the model reads and writes them in place.
  // The handles this bind makes torch leak are reclaimed by ReclaimBindHandles,
  // which callers run after the bind's first run, off the critical path when
  // the run is asynchronous.
  void BindUserManaged(const std::vector<AOTInductorConstantMapEntry>& pairs, ErrorKind kind);
  // Makes `pairs` (every constant the model reads) the container's whole
  // constant set: binds them into the inactive set, swaps it in and frees the
  // container's own weight blob. Afterwards the container holds no tensor
  // memory of its own.
  void ReplaceAllUserManaged(const std::vector<AOTInductorConstantMapEntry>& pairs,
                             ErrorKind kind);
  // Whether the container holds its constants itself (weights embedded in the
  // library, copied into a blob at creation), as opposed to a library compiled
  // without weights, whose constants must all be bound before a run.
  bool holds_own_constants() const { return holds_own_constants_; }
  // Deletes the handles the previous binds made and torch never frees; keeps
  // the latest bind's. No-op unless the container reclaims.
  void ReclaimBindHandles(ErrorKind kind);

  // Runs the model through the container's single-threaded entry: every
  // container is used by one thread at a time (the runner's lanes), and the
  // threaded entry, with one model instance, waits on the host for the
  // previous run's completion event before it queues the next, and records
  // events a CUDA graph capture cannot contain (docs/aoti-runtime.md).
  // Inputs are consumed; returns the outputs (owned).
  std::vector<OwnedTensor> Run(std::vector<OwnedTensor>&& inputs, StreamHandle stream);

 private:
  // Throws "`what` failed for <library>: <reason>"; the reason is the
  // runtime's last error where none is given.
  [[noreturn]] void Fail(ErrorKind kind, const std::string& what,
                         const std::string& reason = "") const;
  // Records the handles a bind of `pairs` made, for ReclaimBindHandles.
  void TrackBindHandles(const std::vector<AOTInductorConstantMapEntry>& pairs);

  std::shared_ptr<ModelLibrary> library_;
  AOTInductorModelContainerHandle handle_ = nullptr;
  std::vector<ConstantInfo> constants_;
  std::unordered_map<std::string, std::string> fqn_of_name_;
  std::vector<std::string> input_names_;
  size_t num_outputs_ = 0;
  std::string in_spec_;
  std::string out_spec_;
  bool reclaim_bind_handles_;
  std::shared_ptr<ProxyExecutor> proxy_;
  bool holds_own_constants_ = false;
  // Per bound constant: the handle the container made for our latest bind of
  // it, deleted once a later bind replaced it (torch leaks it).
  struct BindCopy {
    AtenTensorHandle bound = nullptr;  // the caller's tensor handed to the bind
    AtenTensorHandle copy = nullptr;   // the container's wrapper of it
    size_t entry = 0;                  // position in ExtractConstantsMapEntries
    const std::string* fqn = nullptr;  // key of this slot
  };
  std::unordered_map<std::string, BindCopy> bind_copies_;  // by FQN
  std::vector<BindCopy*> pending_;  // bound since the last reclaim
};

}  // namespace aoti_sessions
