// Ops a compiled model runs through AOTInductor's proxy executor: fallback
// kernels and custom ops (torch.library) have no C shim entry, so the model's
// generated code calls aoti_torch_proxy_executor_call_function(executor, node,
// ints, tensors), which libtorch forwards to the executor's call_function.
//
// torch's own executor (OSSProxyExecutor) is not exported from libtorch. This
// one has the layout of torch::aot_inductor::ProxyExecutor (no data before
// the vtable; a virtual destructor, then call_function: slots the Itanium C++
// ABI fixes, the same in torch 2.11 through 2.14) and hands every call to a
// ProxyCall its owner supplies (the Python bindings: aoti_sessions/_proxy.py
// reads the library's extern-kernel description and calls the op). The core
// stays free of torch headers.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "aoti_abi.h"
#include "torch_shim.h"

namespace aoti_sessions {

// One call of extern node `node` (its index in the library's description):
// the integer arguments and the tensor arguments (inputs, then the outputs it
// is to fill), borrowed for the call. Returns (index into `tensors`, result)
// for each output: the result is assigned to that argument, as torch's own
// executor does. Throws (any std::exception) to fail the run; the message
// becomes the run's error.
using ProxyCall = std::function<std::vector<std::pair<size_t, OwnedTensor>>(
    int node, const std::vector<int64_t>& ints, const std::vector<AtenTensorHandle>& tensors)>;

class ProxyExecutor {
 public:
  explicit ProxyExecutor(ProxyCall call) : call_(std::move(call)) {}
  virtual ~ProxyExecutor() = default;
  ProxyExecutor(const ProxyExecutor&) = delete;
  ProxyExecutor& operator=(const ProxyExecutor&) = delete;

  // The entry torch's shim calls (the second virtual slot; proxy_entry.cc).
  // Thread-safe: the call itself must be. A failed call throws, as the shim
  // expects, a std::runtime_error of torch's own C++ runtime (libstdc++),
  // whatever runtime this core was built with.
  virtual void call_function(int extern_node_index, int num_ints, int64_t* flatten_int_args,
                             int num_tensors, AtenTensorHandle* flatten_tensor_args);

  AOTIProxyExecutorHandle handle() { return reinterpret_cast<AOTIProxyExecutorHandle>(this); }

  // The message of this thread's last failed call, cleared by reading ("" if none).
  static std::string TakeLastError();

 private:
  // The call itself: nullptr when it succeeded, else its message (this
  // thread's last error, until the next call). Never throws.
  const char* Call(int extern_node_index, int num_ints, int64_t* flatten_int_args,
                   int num_tensors, AtenTensorHandle* flatten_tensor_args) noexcept;

  ProxyCall call_;
};

}  // namespace aoti_sessions
