// Model library loading (dlopen, dlsym) and the container calls: descriptor
// capture, user-managed binds with handle reclaim, runs.
#include "container.h"

#include <dlfcn.h>

#include <cstring>
#include <utility>

#include "elf_check.h"
#include "errors.h"

namespace aoti_sessions {
namespace {

bool IsCudaRuntime(const std::string& library) {
  for (const char* prefix : {"libcuda.so", "libcudart", "libtorch_cuda", "libc10_cuda"}) {
    if (library.compare(0, std::strlen(prefix), prefix) == 0) return true;
  }
  return false;
}

template <typename Fn>
void Require(void* handle, const std::string& path, Fn& fn, const char* name) {
  fn = reinterpret_cast<Fn>(dlsym(handle, name));
  if (fn == nullptr) {
    Throw(ErrorKind::kPackage, "model library " + path + " does not export " + name +
                                   ": not an AOTInductor model library of torch 2.11-2.14");
  }
}

template <typename Fn>
void Optional(void* handle, Fn& fn, const char* name) {
  fn = reinterpret_cast<Fn>(dlsym(handle, name));
}

}  // namespace

std::shared_ptr<ModelLibrary> ModelLibrary::Open(const std::string& path) {
  Shim();  // libtorch must be loaded before the model library can be
  ElfInfo elf = ReadElf(path);
  if (elf.elf64 && !elf.complete) {
    Throw(ErrorKind::kPackage, "model library " + path + " is truncated or corrupt");
  }
  std::shared_ptr<ModelLibrary> lib(new ModelLibrary());
  lib->path_ = path;
  lib->handle_ = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib->handle_ == nullptr) {
    const char* why = dlerror();
    Throw(ErrorKind::kPackage, "cannot load model library " + path + ": " + (why ? why : "?"));
  }
  void* h = lib->handle_;
  Require(h, path, lib->create_with_device, "AOTInductorModelContainerCreateWithDevice");
  Require(h, path, lib->destroy, "AOTInductorModelContainerDelete");
  Require(h, path, lib->run, "AOTInductorModelContainerRun");
  Require(h, path, lib->run_single_threaded, "AOTInductorModelContainerRunSingleThreaded");
  Require(h, path, lib->num_constants, "AOTInductorModelContainerGetNumConstants");
  Require(h, path, lib->constant_name, "AOTInductorModelContainerGetConstantName");
  Require(h, path, lib->constant_fqn, "AOTInductorModelContainerGetConstantOriginalFQN");
  Require(h, path, lib->constant_from_folded, "AOTInductorModelContainerGetConstantFromFolded");
  Require(h, path, lib->constant_type, "AOTInductorModelContainerGetConstantType");
  Require(h, path, lib->constant_dtype, "AOTInductorModelContainerGetConstantDtype");
  Require(h, path, lib->constant_data_size, "AOTInductorModelContainerGetConstantDataSize");
  Require(h, path, lib->num_inputs, "AOTInductorModelContainerGetNumInputs");
  Require(h, path, lib->input_name, "AOTInductorModelContainerGetInputName");
  Require(h, path, lib->num_outputs, "AOTInductorModelContainerGetNumOutputs");
  Require(h, path, lib->output_name, "AOTInductorModelContainerGetOutputName");
  Require(h, path, lib->call_spec, "AOTInductorModelContainerGetCallSpec");
  Require(h, path, lib->update_user_managed_pairs,
          "AOTInductorModelContainerUpdateUserManagedConstantBufferPairs");
  Require(h, path, lib->swap_constant_buffer, "AOTInductorModelContainerSwapConstantBuffer");
  Require(h, path, lib->free_inactive_constant_buffer,
          "AOTInductorModelContainerFreeInactiveConstantBuffer");
  Optional(h, lib->extract_entries, "AOTInductorModelContainerExtractConstantsMapEntries");
  Optional(h, lib->extract_map, "AOTInductorModelContainerExtractConstantsMap");
  Optional(h, lib->last_error, "AOTInductorGetLastError");
  if (lib->extract_entries == nullptr && lib->extract_map == nullptr) {
    Throw(ErrorKind::kPackage, "model library " + path +
                                   " exports no AOTInductorModelContainerExtractConstantsMap*");
  }
#ifdef _LIBCPP_VERSION
  // Without the entries (torch < 2.13) a library hands its constants over as a
  // libstdc++ std::unordered_map, which a core built with libc++ (the
  // manylinux wheels: scripts/build-wheels) cannot read.
  if (lib->extract_entries == nullptr) {
    Throw(ErrorKind::kPackage,
          "model library " + path +
              " was compiled by torch older than 2.13 (it exports no "
              "AOTInductorModelContainerExtractConstantsMapEntries): this build of aoti-sessions "
              "(libc++, a manylinux wheel) reads only torch >= 2.13's libraries; compile the "
              "model with torch >= 2.13, or install aoti-sessions from source, which builds "
              "with the system's libstdc++ (docs/development.md)");
  }
#endif
  for (const std::string& needed : elf.needed) {
    lib->targets_cuda_ = lib->targets_cuda_ || IsCudaRuntime(needed);
  }
  return lib;
}

ModelLibrary::~ModelLibrary() {
  if (handle_ != nullptr) dlclose(handle_);
}

std::string ModelLibrary::LastError() const {
  const char* message = nullptr;
  if (last_error != nullptr && last_error(&message) == 0 && message != nullptr && *message) {
    // c10 errors carry a C++ backtrace after the message; the message is enough.
    std::string text = message;
    size_t trace = text.find("\nException raised from");
    return trace == std::string::npos ? text : text.substr(0, trace);
  }
  return "the model runtime printed the reason to stderr";
}

Container::Container(std::shared_ptr<ModelLibrary> library, const DeviceSpec& device,
                     const std::string& cubin_dir, bool reclaim_bind_handles,
                     std::shared_ptr<ProxyExecutor> proxy)
    : library_(std::move(library)),
      reclaim_bind_handles_(reclaim_bind_handles),
      proxy_(std::move(proxy)) {
  const ModelLibrary& lib = *library_;
  std::string device_str = device.ToString();
  if (lib.create_with_device(&handle_, 1, device_str.c_str(),
                             cubin_dir.empty() ? nullptr : cubin_dir.c_str()) != 0) {
    handle_ = nullptr;
    Fail(ErrorKind::kPackage, "cannot create a model container on " + device_str);
  }
  try {
    size_t n = 0;
    if (lib.num_constants(handle_, &n) != 0) Fail(ErrorKind::kPackage, "GetNumConstants");
    constants_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      ConstantInfo& c = constants_[i];
      const char* name = nullptr;
      const char* fqn = nullptr;
      int32_t type = 0;
      if (lib.constant_name(handle_, i, &name) != 0 || lib.constant_fqn(handle_, i, &fqn) != 0 ||
          lib.constant_from_folded(handle_, i, &c.from_folded) != 0 ||
          lib.constant_type(handle_, i, &type) != 0 ||
          lib.constant_dtype(handle_, i, &c.dtype) != 0 ||
          lib.constant_data_size(handle_, i, &c.data_size) != 0) {
        Fail(ErrorKind::kPackage, "reading constant descriptor " + std::to_string(i));
      }
      c.name = name;
      c.fqn = fqn;
      c.type = static_cast<abi::ConstantType>(type);
      fqn_of_name_[c.name] = c.fqn;
    }
    if (lib.num_inputs(handle_, &n) != 0) Fail(ErrorKind::kPackage, "GetNumInputs");
    for (size_t i = 0; i < n; ++i) {
      const char* name = nullptr;
      if (lib.input_name(handle_, i, &name) != 0) Fail(ErrorKind::kPackage, "GetInputName");
      input_names_.emplace_back(name);
    }
    if (lib.num_outputs(handle_, &num_outputs_) != 0) Fail(ErrorKind::kPackage, "GetNumOutputs");
    const char* in_spec = nullptr;
    const char* out_spec = nullptr;
    if (lib.call_spec(handle_, &in_spec, &out_spec) != 0) Fail(ErrorKind::kPackage, "GetCallSpec");
    in_spec_ = in_spec ? in_spec : "";
    out_spec_ = out_spec ? out_spec : "";
    // A library compiled without weights creates an empty constant map.
    holds_own_constants_ = !CurrentConstants(ErrorKind::kPackage).empty();
  } catch (...) {
    lib.destroy(handle_);
    throw;
  }
}

Container::~Container() {
  try {
    ReclaimBindHandles(ErrorKind::kInternal);
  } catch (...) {
    // Leaking a few handles beats throwing from a destructor.
  }
  if (handle_ != nullptr) library_->destroy(handle_);
  // The container never frees the handles our binds made it create.
  const TorchShim& shim = Shim();
  for (auto& [fqn, slot] : bind_copies_) {
    if (slot.copy != nullptr) shim.delete_tensor_object(slot.copy);
  }
}

void Container::Fail(ErrorKind kind, const std::string& what, const std::string& reason) const {
  Throw(kind, what + " failed for " + library_->path() + ": " +
                  (reason.empty() ? library_->LastError() : reason));
}

std::unordered_map<std::string, AtenTensorHandle> Container::CurrentConstants(ErrorKind kind) {
  std::unordered_map<std::string, AtenTensorHandle> current;
  if (library_->extract_entries != nullptr) {
    const AOTInductorConstantMapEntry* entries = nullptr;
    size_t n = 0;
    if (library_->extract_entries(handle_, &entries, &n, false) != 0) {
      Fail(kind, "ExtractConstantsMapEntries");
    }
    current.reserve(n);
    for (size_t i = 0; i < n; ++i) current.emplace(entries[i].name, entries[i].handle);
  } else {
    // torch < 2.13: the map crosses the library boundary as a std::unordered_map,
    // which is sound because model libraries and this core share libstdc++
    // (a core built with libc++ refuses such libraries at load: ModelLibrary::Open).
    if (library_->extract_map(handle_, reinterpret_cast<AOTInductorConstantMapHandle>(&current),
                              false) != 0) {
      Fail(kind, "ExtractConstantsMap");
    }
  }
  return current;
}

void Container::BindUserManaged(const std::vector<AOTInductorConstantMapEntry>& pairs,
                                ErrorKind kind) {
  if (library_->update_user_managed_pairs(handle_, pairs.data(), pairs.size(), false, false) !=
      0) {
    Fail(kind, "UpdateUserManagedConstantBufferPairs");
  }
  TrackBindHandles(pairs);
}

void Container::ReplaceAllUserManaged(const std::vector<AOTInductorConstantMapEntry>& pairs,
                                      ErrorKind kind) {
  // Two rounds of (bind the inactive set, swap it in, free the other): the
  // first frees the container's own blob, the second makes the set the
  // container started with the active one again, now holding `pairs`. torch
  // 2.11's single-threaded run checks the folding state of that first set
  // whichever set is active, and refuses to run ("Unknown constant state")
  // once it was freed (docs/aoti-runtime.md).
  for (int round = 0; round < 2; ++round) {
    if (library_->update_user_managed_pairs(handle_, pairs.data(), pairs.size(), true, false) !=
        0) {
      Fail(kind, "UpdateUserManagedConstantBufferPairs (inactive set)");
    }
    if (library_->swap_constant_buffer(handle_) != 0) Fail(kind, "SwapConstantBuffer");
    if (library_->free_inactive_constant_buffer(handle_) != 0) {
      Fail(kind, "FreeInactiveConstantBuffer");
    }
    // The handles this bind made are in the set that is active now.
    TrackBindHandles(pairs);
    ReclaimBindHandles(kind);
  }
  holds_own_constants_ = false;
}

void Container::TrackBindHandles(const std::vector<AOTInductorConstantMapEntry>& pairs) {
  if (!reclaim_bind_handles_) return;
  for (const auto& pair : pairs) {
    auto name = fqn_of_name_.find(pair.name);
    if (name == fqn_of_name_.end()) {
      Throw(ErrorKind::kInternal, std::string("bound an unknown constant '") + pair.name + "'");
    }
    auto [it, added] = bind_copies_.try_emplace(name->second);
    it->second.fqn = &it->first;
    it->second.bound = pair.handle;
    pending_.push_back(&it->second);
  }
}

void Container::ReclaimBindHandles(ErrorKind kind) {
  if (pending_.empty()) return;
  const TorchShim& shim = Shim();
  auto adopt = [&shim](BindCopy& slot, AtenTensorHandle current) {
    if (current == nullptr || current == slot.bound || current == slot.copy) return;
    if (slot.copy != nullptr) shim.delete_tensor_object(slot.copy);
    slot.copy = current;
  };
  if (library_->extract_entries != nullptr) {
    const AOTInductorConstantMapEntry* entries = nullptr;
    size_t n = 0;
    if (library_->extract_entries(handle_, &entries, &n, false) != 0) {
      Fail(kind, "ExtractConstantsMapEntries");
    }
    for (BindCopy* slot : pending_) {
      // Entry positions are stable between binds; search only on a miss.
      if (slot->entry >= n || *slot->fqn != entries[slot->entry].name) {
        slot->entry = n;
        for (size_t i = 0; i < n && slot->entry == n; ++i) {
          if (*slot->fqn == entries[i].name) slot->entry = i;
        }
      }
      if (slot->entry < n) adopt(*slot, entries[slot->entry].handle);
    }
  } else {
    auto current = CurrentConstants(kind);
    for (BindCopy* slot : pending_) {
      auto it = current.find(*slot->fqn);
      if (it != current.end()) adopt(*slot, it->second);
    }
  }
  pending_.clear();
}

std::vector<OwnedTensor> Container::Run(std::vector<OwnedTensor>&& inputs, StreamHandle stream) {
  std::vector<AtenTensorHandle> in(inputs.size());
  // The container steals the input handles, whatever the outcome.
  for (size_t i = 0; i < inputs.size(); ++i) in[i] = inputs[i].release();
  std::vector<AtenTensorHandle> out(num_outputs_, nullptr);
  AOTIRuntimeError err = library_->run_single_threaded(
      handle_, in.data(), in.size(), out.data(), out.size(),
      reinterpret_cast<AOTInductorStreamHandle>(stream),
      proxy_ != nullptr ? proxy_->handle() : nullptr);
  std::vector<OwnedTensor> outputs;
  outputs.reserve(out.size());
  for (AtenTensorHandle h : out) outputs.emplace_back(h);
  if (err != 0) {
    // An op run through the proxy executor says what failed better than torch does.
    Fail(ErrorKind::kRun, "running the model",
         proxy_ != nullptr ? ProxyExecutor::TakeLastError() : "");
  }
  return outputs;
}

}  // namespace aoti_sessions
