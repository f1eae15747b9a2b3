#include "proxy_executor.h"

#include <exception>
#include <stdexcept>

#include "errors.h"

namespace aoti_sessions {
namespace {

thread_local std::string last_error;

}  // namespace

const char* ProxyExecutor::Call(int extern_node_index, int num_ints, int64_t* flatten_int_args,
                                int num_tensors, AtenTensorHandle* flatten_tensor_args) noexcept {
  try {
    std::vector<int64_t> ints(flatten_int_args, flatten_int_args + num_ints);
    std::vector<AtenTensorHandle> tensors(flatten_tensor_args, flatten_tensor_args + num_tensors);
    std::vector<std::pair<size_t, OwnedTensor>> results = call_(extern_node_index, ints, tensors);
    for (auto& [index, result] : results) {
      if (index >= tensors.size() || result.get() == nullptr) {
        Throw(ErrorKind::kInternal, "extern node " + std::to_string(extern_node_index) +
                                        ": a result for argument " + std::to_string(index) +
                                        " of " + std::to_string(tensors.size()));
      }
      if (Shim().assign_tensors(result.get(), tensors[index]) != 0) {
        Throw(ErrorKind::kInternal, "torch shim call failed: assign_tensors");
      }
    }
    return nullptr;
  } catch (const std::exception& e) {
    last_error = e.what();
  } catch (...) {
    last_error = "extern node " + std::to_string(extern_node_index) + " failed";
  }
  return last_error.c_str();
}

std::string ProxyExecutor::TakeLastError() {
  std::string message = std::move(last_error);
  last_error.clear();
  return message;
}

}  // namespace aoti_sessions
