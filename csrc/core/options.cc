// The rules on an engine's methods and options, each checked once, here.
#include "options.h"

#include <cmath>
#include <set>

#include "errors.h"
#include "util.h"

namespace aoti_sessions {
void PoolSource::Validate(const std::optional<std::vector<InputSpec>>& specs,
                          const std::string& method) const {
  if (!specs) {
    Throw(ErrorKind::kPackage, method + ": a pooled method needs its recorded input specs");
  }
  const std::vector<InputSpec>& inputs = *specs;
  std::set<size_t> used;
  auto input = [&](size_t index, const std::string& role) -> const InputSpec& {
    if (index >= inputs.size() || !used.insert(index).second) {
      Throw(ErrorKind::kPackage, method + ": pool " + role + " is input " + std::to_string(index) +
                                     ", which is out of range (" +
                                     std::to_string(inputs.size()) + " inputs) or used twice");
    }
    return inputs[index];
  };
  auto require = [&](const InputSpec& spec, const std::string& role, const char* dtype,
                     size_t rank) {
    if (spec.dtype != DtypeFromName(dtype) || spec.sizes.size() != rank) {
      Throw(ErrorKind::kPackage, method + ": pool " + role + " must be " + dtype + " of rank " +
                                     std::to_string(rank) + ", got " + DtypeName(spec.dtype) +
                                     FormatDims(spec.sizes));
    }
  };
  bool pages = false, slots = false;
  std::set<std::string> names;
  for (const PooledInput& t : tensors) {
    const InputSpec& spec = input(t.input, "tensor '" + t.name + "'");
    if (t.name.empty() || !names.insert(t.name).second) {
      Throw(ErrorKind::kPackage, method + ": pooled tensor names must be unique and non-empty");
    }
    bool rest_static = spec.sizes.size() >= 1;
    for (size_t d = 1; d < spec.sizes.size(); ++d) rest_static = rest_static && spec.sizes[d] >= 0;
    if (!rest_static) {
      Throw(ErrorKind::kPackage, method + ": pooled tensor '" + t.name + "' is " +
                                     FormatDims(spec.sizes) +
                                     "; only its first dimension (units) may be dynamic");
    }
    (t.kind == PoolKind::kPages ? pages : slots) = true;
  }
  if (tensors.empty()) Throw(ErrorKind::kPackage, method + ": a pool needs pooled tensors");
  const InputSpec& fed = input(tokens, "tokens");
  if (fed.sizes.size() < 2) {
    Throw(ErrorKind::kPackage, method + ": pool tokens input must be [rows, positions, ...], got " +
                                   FormatDims(fed.sizes));
  }
  if (pages != page_table.has_value() || pages != positions.has_value() ||
      slots != slot_ids.has_value()) {
    Throw(ErrorKind::kPackage, method + ": a pool with page tensors needs page_table and "
                                        "positions inputs, one with slot tensors slot_ids, and "
                                        "only those");
  }
  if (pages && page_size < 1) {
    Throw(ErrorKind::kPackage, method + ": pool page_size must be >= 1, got " +
                                   std::to_string(page_size));
  }
  if (page_table) {
    const InputSpec& table = input(*page_table, "page_table");
    require(table, "page_table", "int32", 2);
    if (table.sizes[1] < 1 && max_pages < 1) {
      Throw(ErrorKind::kPackage, method + ": pool page_table's width is dynamic (" +
                                     FormatDims(table.sizes) + ") but its bound, max_pages, is not given");
    }
  }
  if (positions) require(input(*positions, "positions"), "positions", "int64", 1);
  if (slot_ids) require(input(*slot_ids, "slot_ids"), "slot_ids", "int32", 1);
  if (max_rows < 1) {
    Throw(ErrorKind::kPackage, method + ": pool max_rows must be >= 1, got " +
                                   std::to_string(max_rows));
  }
  if (min_rows < 1 || min_rows > max_rows) {
    Throw(ErrorKind::kPackage, method + ": pool min_rows must be in [1, max_rows=" +
                                   std::to_string(max_rows) + "], got " +
                                   std::to_string(min_rows));
  }
}

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
    if (source.pool) source.pool->Validate(source.inputs, method);
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
