// The rules on an engine's methods and options, each checked once, here.
#include "options.h"

#include <cmath>
#include <set>

#include "errors.h"
#include "util.h"

namespace aoti_sessions {

void ValidateSources(const std::vector<MethodSource>& methods) {
  if (methods.empty()) Throw(ErrorKind::kInvalidArgument, "an engine needs at least one method");
  std::set<std::string> names;
  for (const MethodSource& source : methods) {
    if (source.name.empty() || !names.insert(source.name).second) {
      Throw(ErrorKind::kInvalidArgument, "method names must be unique and non-empty, got '" +
                                             source.name + "' twice or empty");
    }
    const std::string method = "method '" + source.name + "'";
    RequireValidPath(source.library_path, (method + ": library path").c_str());
    RequireValidPath(source.cubin_dir, (method + ": kernel folder").c_str());
    if (source.weights) RequireValidPath(source.weights->path, (method + ": weights file").c_str());
    if (!source.inputs) continue;
    for (size_t i = 0; i < source.inputs->size(); ++i) {
      const InputSpec& input = (*source.inputs)[i];
      if (!input.strides.empty() && input.strides.size() != input.sizes.size()) {
        Throw(ErrorKind::kPackage, method + ": input " + std::to_string(i) + " has " +
                                       std::to_string(input.sizes.size()) + " sizes but " +
                                       std::to_string(input.strides.size()) + " strides");
      }
    }
  }
}

void EngineOptions::Validate() const {
  if (max_sessions && *max_sessions <= 0) {
    Throw(ErrorKind::kInvalidArgument,
          "max_sessions must be positive, got " + std::to_string(*max_sessions));
  }
  if (memory_budget && *memory_budget < 0) {
    Throw(ErrorKind::kInvalidArgument,
          "memory_budget must be >= 0 bytes, got " + std::to_string(*memory_budget));
  }
  if (host_budget && *host_budget < 0) {
    Throw(ErrorKind::kInvalidArgument,
          "host_budget must be >= 0 bytes, got " + std::to_string(*host_budget));
  }
  if (lanes && (*lanes < 1 || *lanes > kMaxLanes)) {
    Throw(ErrorKind::kInvalidArgument, "lanes must be between 1 and " +
                                           std::to_string(kMaxLanes) + ", got " +
                                           std::to_string(*lanes));
  }
  if (cuda_graphs == GraphMode::kOn && device.rfind("cuda", 0) != 0) {
    Throw(ErrorKind::kInvalidArgument,
          "cuda_graphs=True needs a CUDA engine, but the device is " + device);
  }
  if (idle_timeout_seconds &&
      !(*idle_timeout_seconds > 0 && std::isfinite(*idle_timeout_seconds))) {
    Throw(ErrorKind::kInvalidArgument, "idle_timeout must be > 0 seconds and finite, got " +
                                           std::to_string(*idle_timeout_seconds));
  }
}

}  // namespace aoti_sessions
