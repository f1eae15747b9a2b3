// Shared helpers of the core's C++ tests: test model paths and host tensors.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/engine.h"
#include "core/errors.h"
#include "core/session.h"
#include "core/torch_shim.h"

namespace aoti_sessions::testing {

// The kind of the Error `fn` throws; a test failure if it throws none.
template <typename Fn>
ErrorKind KindOf(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.kind();
  }
  ADD_FAILURE() << "no error thrown";
  return ErrorKind::kInternal;
}

// Path of a compiled test model library from the environment variable `name`
// (set by tests/test_cpp.py); fails the test when unset.
std::string ModelPath(const char* name);

// A CPU tensor aliasing `data` (not owning it) with a contiguous layout.
template <typename T>
OwnedTensor HostTensor(std::vector<T>& data, const std::vector<int64_t>& sizes, const char* dtype) {
  TensorLayout layout;
  layout.dtype = DtypeFromName(dtype);
  layout.sizes = sizes;
  layout.strides.assign(sizes.size(), 1);
  for (size_t i = sizes.size(); i-- > 1;) layout.strides[i - 1] = layout.strides[i] * sizes[i];
  return OwnedTensor::FromBlob(data.data(), layout, Shim().device_type_cpu, 0);
}

// One method named "model" from the library at `path`.
std::vector<MethodSource> OneMethod(const std::string& path);

// Runs the Counter test model once: x = `value` everywhere, slot = `slot`.
std::vector<float> RunCounter(Session& session, float value, int64_t slot);

// Copies mutable buffer `fqn` of `session` (of `engine`) to the host.
template <typename T>
std::vector<T> ReadBuffer(const Engine& engine, Session& session, const std::string& fqn) {
  size_t index = engine.buffer_index(fqn);
  const MutableBuffer& buffer = engine.mutable_buffers()[index];
  std::vector<T> out(buffer.layout.numel());
  OwnedTensor dst = OwnedTensor::FromBlob(out.data(), buffer.layout, Shim().device_type_cpu, 0);
  session.ReadBuffer(index, dst.get());
  return out;
}

}  // namespace aoti_sessions::testing
