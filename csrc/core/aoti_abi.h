// The C ABIs the core speaks: the AOTInductor container functions exported by
// every compiled model library, and the subset of torch's `aoti_torch_*` shim
// the core calls. Declared here (not included from torch) so the core builds
// without torch headers and one build serves torch 2.11 through 2.14; every
// function is resolved at run time with dlsym, never linked.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

// Opaque torch tensor: an owning `at::Tensor*` behind the shim.
struct AtenTensorOpaque;
using AtenTensorHandle = AtenTensorOpaque*;

struct AOTInductorModelContainerOpaque;
using AOTInductorModelContainerHandle = AOTInductorModelContainerOpaque*;
struct AOTInductorStreamOpaque;
using AOTInductorStreamHandle = AOTInductorStreamOpaque*;
struct AOTIProxyExecutorOpaque;
using AOTIProxyExecutorHandle = AOTIProxyExecutorOpaque*;
struct AOTInductorConstantMap;
using AOTInductorConstantMapHandle = AOTInductorConstantMap*;

// 0 = success, 1 = failure, for both the container and the shim.
using AOTIRuntimeError = int32_t;
using AOTITorchError = int32_t;

// One (internal constant name, tensor) pair of the ABI-safe `*Pairs` calls.
struct AOTInductorConstantMapEntry {
  const char* name;
  AtenTensorHandle handle;
};

}  // extern "C"

namespace aoti_sessions::abi {

// Container entry points (signatures as in torch's aoti_runtime/interface.h).
using CreateWithDeviceFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle*, size_t,
                                                const char*, const char*);
using DeleteFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle);
using RunFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle, AtenTensorHandle*, size_t,
                                   AtenTensorHandle*, size_t, AOTInductorStreamHandle,
                                   AOTIProxyExecutorHandle);
using GetCountFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle, size_t*);
using GetNameFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle, size_t, const char**);
using GetBoolFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle, size_t, bool*);
using GetInt32Fn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle, size_t, int32_t*);
using GetSizeFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle, size_t, size_t*);
using GetCallSpecFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle, const char**,
                                           const char**);
using UpdatePairsFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle,
                                           const AOTInductorConstantMapEntry*, size_t, bool,
                                           bool);
using ExtractEntriesFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle,
                                              const AOTInductorConstantMapEntry**, size_t*,
                                              bool);
using ExtractMapFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle,
                                          AOTInductorConstantMapHandle, bool);
using GetLastErrorFn = AOTIRuntimeError (*)(const char**);
using HandleOnlyFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle);

// ConstantType values of the container (no "mutated" flag exists).
enum class ConstantType : int32_t {
  kUnknown = 0,
  kParameter = 1,
  kBuffer = 2,
  kTensorConstant = 3,
  kFoldedConstant = 4,
};

}  // namespace aoti_sessions::abi
