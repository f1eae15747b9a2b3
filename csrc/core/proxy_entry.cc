// ProxyExecutor::call_function, the entry torch's shim calls. This file is
// compiled without exceptions (CMakeLists.txt), so its frames carry no
// personality routine of this core's C++ runtime: the shim catches a failed
// call's exception as a std::exception of its own runtime (libstdc++), and an
// exception of another runtime (libc++, which the manylinux wheels link in)
// thrown through it would end the process. So the call runs in Call (which
// never throws) and a failure is thrown here as libstdc++'s
// std::runtime_error, made with the functions of the libstdc++ already loaded
// (libtorch's): one path whichever runtime built the core.
#include <dlfcn.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>

#include "proxy_executor.h"

namespace aoti_sessions {
namespace {

// sizeof(std::runtime_error) in libstdc++: its vtable pointer and a
// reference-counted string (one pointer), the same since GCC 5.
constexpr size_t kRuntimeErrorBytes = 2 * sizeof(void*);

[[noreturn]] void ThrowToTorch(const char* message) {
  using Allocate = void* (*)(size_t);
  using Construct = void (*)(void*, const char*);
  using Destroy = void (*)(void*);
  using CxaThrow = void (*)(void*, void*, Destroy);
  if (void* lib = dlopen("libstdc++.so.6", RTLD_LAZY | RTLD_NOLOAD)) {
    auto allocate = reinterpret_cast<Allocate>(dlsym(lib, "__cxa_allocate_exception"));
    auto construct = reinterpret_cast<Construct>(dlsym(lib, "_ZNSt13runtime_errorC1EPKc"));
    auto destroy = reinterpret_cast<Destroy>(dlsym(lib, "_ZNSt13runtime_errorD1Ev"));
    void* type = dlsym(lib, "_ZTISt13runtime_error");
    auto cxa_throw = reinterpret_cast<CxaThrow>(dlsym(lib, "__cxa_throw"));
    if (allocate != nullptr && construct != nullptr && destroy != nullptr && type != nullptr &&
        cxa_throw != nullptr) {
      void* error = allocate(kRuntimeErrorBytes);
      construct(error, message);
      cxa_throw(error, type, destroy);
    }
  }
  // (torch's shim is libstdc++'s: a process running it has it loaded.)
  std::fprintf(stderr, "aoti-sessions: a custom op failed (%s) and libstdc++ is not loaded to report it\n",
               message);
  std::abort();
}

}  // namespace

void ProxyExecutor::call_function(int extern_node_index, int num_ints, int64_t* flatten_int_args,
                                  int num_tensors, AtenTensorHandle* flatten_tensor_args) {
  const char* failed =
      Call(extern_node_index, num_ints, flatten_int_args, num_tensors, flatten_tensor_args);
  if (failed != nullptr) ThrowToTorch(failed);
}

}  // namespace aoti_sessions
