// Test helpers shared by the core's C++ tests.
#include "test_helpers.h"

#include <gtest/gtest.h>

#include <cstdlib>

namespace aoti_sessions::testing {

std::string ModelPath(const char* name) {
  const char* path = std::getenv(name);
  if (path == nullptr || *path == '\0') {
    ADD_FAILURE() << name << " is not set: run these tests through tests/test_cpp.py";
    return "";
  }
  return path;
}

std::vector<MethodSource> OneMethod(const std::string& path) {
  MethodSource source;
  source.name = "model";
  source.library_path = path;
  return {source};
}

std::vector<float> RunCounter(Session& session, float value, int64_t slot) {
  std::vector<float> x(8, value);
  std::vector<int64_t> s{slot};
  std::vector<OwnedTensor> inputs;
  inputs.push_back(HostTensor(x, {1, 8}, "float32"));
  inputs.push_back(HostTensor(s, {1}, "int64"));
  std::vector<OwnedTensor> outputs = session.Run(0, std::move(inputs));
  EXPECT_EQ(outputs.size(), 1u);
  auto* data = static_cast<float*>(DataPtr(outputs.at(0).get()));
  return std::vector<float>(data, data + 8);
}

}  // namespace aoti_sessions::testing
