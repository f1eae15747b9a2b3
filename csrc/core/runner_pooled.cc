// The run path of pooled methods (docs/batching.md): a batch's inputs as the
// model takes them (the caller's padded to a graph bucket, the pool's
// tensors, the addressing) and its replay or run on a lane.
#include <algorithm>
#include <optional>

#include "errors.h"
#include "runner.h"
#include "util.h"

namespace aoti_sessions {

int64_t BatchBucket(int64_t rows, int64_t max_rows) {
  int64_t bucket = rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : (rows + 7) / 8 * 8;
  return std::max(rows, std::min(bucket, max_rows));
}

int64_t WidthBucket(int64_t width, int64_t max_pages) {
  int64_t bucket = 1;
  while (bucket < width) bucket *= 2;
  return std::max(width, std::min(bucket, max_pages));
}

namespace {

// A new device tensor of `layout` holding `bytes` from `src` (host or
// device), the rest zero; ordered on `stream`.
OwnedTensor Filled(Device& device, const TensorLayout& layout, const void* src, size_t bytes,
                   StreamHandle stream) {
  OwnedTensor out = OwnedTensor::Empty(layout, device.torch_device_type(), device.spec().index);
  const size_t total = layout.span_bytes();
  char* dst = static_cast<char*>(DataPtr(out.get()));
  if (bytes > 0) device.Copy(dst, src, bytes, stream);
  if (total > bytes) device.Zero(dst + bytes, total - bytes, stream);
  return out;
}

TensorLayout Contiguous(int32_t dtype, std::vector<int64_t> sizes) {
  TensorLayout layout;
  layout.dtype = dtype;
  layout.sizes = std::move(sizes);
  layout.strides = ContiguousStrides(layout.sizes);
  return layout;
}

// The key a lane of a pooled method is "bound" with: nothing is bound.
constexpr uint64_t kPooledBindKey = UINT64_MAX;

}  // namespace

std::vector<OwnedTensor> Runner::PooledInputs(const Method& method, const StatePool::Use& use,
                                              const PoolRows& rows, int64_t padded,
                                              std::vector<OwnedTensor>& inputs,
                                              StreamHandle stream) const {
  const PoolSource& source = *method.pool;
  std::vector<OwnedTensor> full(method.num_inputs);
  for (size_t k = 0; k < method.caller_inputs.size(); ++k) {
    OwnedTensor& input = inputs[k];
    if (padded == rows.rows) {
      full[method.caller_inputs[k]] = std::move(input);
      continue;
    }
    TensorLayout layout = ReadLayout(input.get());
    const size_t bytes = layout.span_bytes();
    layout.sizes[0] = padded;
    layout = Contiguous(layout.dtype, layout.sizes);
    full[method.caller_inputs[k]] = Filled(device_, layout, DataPtr(input.get()), bytes, stream);
  }
  std::vector<OwnedTensor> pooled = use.Tensors();
  for (size_t t = 0; t < source.tensors.size(); ++t) {
    full[source.tensors[t].input] = OwnedTensor::Alias(pooled[method.pool_tensors[t]].get());
  }
  if (source.page_table) {
    full[*source.page_table] =
        Filled(device_, Contiguous(DtypeFromName("int32"), {padded, rows.width}),
               rows.page_table.data(), rows.page_table.size() * sizeof(int32_t), stream);
  }
  if (source.positions) {
    full[*source.positions] = Filled(device_, Contiguous(DtypeFromName("int64"), {padded}),
                                     rows.positions.data(), rows.positions.size() * sizeof(int64_t),
                                     stream);
  }
  if (source.slot_ids) {
    // Padding rows get slot 0: the scratch slot (zero bytes here).
    full[*source.slot_ids] = Filled(device_, Contiguous(DtypeFromName("int32"), {padded}),
                                    rows.slot_ids.data(), rows.slot_ids.size() * sizeof(int32_t),
                                    stream);
  }
  return full;
}

std::vector<OwnedTensor> Runner::RunPooled(size_t method, StatePool& pool, const PoolRows& rows,
                                           std::vector<OwnedTensor>&& inputs,
                                           StreamHandle stream) {
  const Method& called = model_->method(method);
  if (!called.pool) {
    // Session::RunBatch refuses such a method before it gets here.
    Throw(ErrorKind::kInternal, "method '" + called.name + "' takes no pooled state");
  }
  const PoolSource& source = *called.pool;
  if (inputs.size() != called.caller_inputs.size()) {
    Throw(ErrorKind::kInvalidArgument,
          "method '" + called.name + "' takes " + std::to_string(called.caller_inputs.size()) +
              " tensor inputs besides the pooled state, got " + std::to_string(inputs.size()));
  }
  if (rows.rows < 1 || rows.rows > source.max_rows) {
    Throw(ErrorKind::kInvalidArgument, "method '" + called.name + "' takes 1 to " +
                                           std::to_string(source.max_rows) +
                                           " sessions in one call, got " +
                                           std::to_string(rows.rows));
  }
  std::vector<std::vector<int64_t>> sizes;
  for (size_t k = 0; k < inputs.size(); ++k) {
    sizes.push_back(ValidateInput(called, called.caller_inputs[k], inputs[k]));
    if (sizes.back().empty() || sizes.back()[0] != rows.rows) {
      Throw(ErrorKind::kInvalidArgument,
            "input " + std::to_string(called.caller_inputs[k]) + " of method '" + called.name +
                "' has " + (sizes.back().empty() ? std::string("no rows") : std::to_string(sizes.back()[0]) + " rows") +
                "; the batch has " + std::to_string(rows.rows) + " sessions");
    }
  }
  const bool captures = graphs_.Captures(method);
  const int64_t padded = std::max(source.min_rows,
                                  captures ? BatchBucket(rows.rows, source.max_rows) : rows.rows);
  // The addressing at the padded size: padding rows write the scratch page
  // and slot, and read nothing of a session's. A captured method whose page
  // table has a dynamic width gets it bucketed (entries past a session's
  // pages are the zero page, as at any width).
  PoolRows full_rows = rows;
  if (captures && source.page_table && (*called.inputs)[*source.page_table].sizes[1] < 0) {
    full_rows.width = WidthBucket(rows.width, pool.layout().max_pages);
    if (full_rows.width > rows.width) {
      const size_t from = static_cast<size_t>(rows.width), to = static_cast<size_t>(full_rows.width);
      full_rows.page_table.assign(static_cast<size_t>(rows.rows) * to, StatePool::kZeroPage);
      for (size_t r = 0; r < static_cast<size_t>(rows.rows); ++r) {
        std::copy_n(rows.page_table.begin() + static_cast<std::ptrdiff_t>(r * from), from,
                    full_rows.page_table.begin() + static_cast<std::ptrdiff_t>(r * to));
      }
    }
  }
  if (padded > rows.rows) {
    const size_t width = static_cast<size_t>(full_rows.width);
    if (source.page_table) {
      full_rows.page_table.resize(static_cast<size_t>(padded) * width);
      for (int64_t r = rows.rows; r < padded; ++r) {
        pool.FillPaddingRow(full_rows.page_table.data() + static_cast<size_t>(r) * width, width);
      }
    }
    full_rows.positions.resize(source.positions ? static_cast<size_t>(padded) : 0, 0);
    full_rows.slot_ids.resize(source.slot_ids ? static_cast<size_t>(padded) : 0,
                              StatePool::kScratchSlot);
  }
  ReaderLock lock(weights_mutex_);
  CheckOpenLocked();
  DeviceScope scope(device_);
  NoteStream(stream);
  runs_.fetch_add(1, std::memory_order_relaxed);
  batch_runs_.fetch_add(1, std::memory_order_relaxed);
  batch_rows_.fetch_add(rows.rows, std::memory_order_relaxed);
  StatePool::Use use(pool, stream);
  std::optional<GraphKey> key;
  if (captures) {
    key = GraphKey{use.epoch(), weights_epoch_, stream, {}};
    // The key's shapes, in input order, without building the inputs.
    std::vector<std::vector<int64_t>> shapes(called.num_inputs);
    for (size_t k = 0; k < inputs.size(); ++k) {
      shapes[called.caller_inputs[k]] = sizes[k];
      shapes[called.caller_inputs[k]][0] = padded;
    }
    std::vector<OwnedTensor> pooled = use.Tensors();
    for (size_t t = 0; t < source.tensors.size(); ++t) {
      shapes[source.tensors[t].input] = ReadLayout(pooled[called.pool_tensors[t]].get()).sizes;
    }
    if (source.page_table) shapes[*source.page_table] = {padded, full_rows.width};
    if (source.positions) shapes[*source.positions] = {padded};
    if (source.slot_ids) shapes[*source.slot_ids] = {padded};
    for (const auto& s : shapes) AppendShapeKey(key->shapes, s);
    if (Graph* graph = graphs_.Find(BatchGraphOwner(padded), method, *key)) {
      std::vector<GraphInput> copies(called.num_inputs);
      for (size_t k = 0; k < inputs.size(); ++k) {
        copies[called.caller_inputs[k]] = {DataPtr(inputs[k].get()),
                                           ReadLayout(inputs[k].get()).span_bytes()};
      }
      if (source.page_table) {
        copies[*source.page_table] = {full_rows.page_table.data(),
                                      full_rows.page_table.size() * sizeof(int32_t)};
      }
      if (source.positions) {
        copies[*source.positions] = {full_rows.positions.data(),
                                     full_rows.positions.size() * sizeof(int64_t)};
      }
      if (source.slot_ids) {
        copies[*source.slot_ids] = {full_rows.slot_ids.data(),
                                    full_rows.slot_ids.size() * sizeof(int32_t)};
      }
      return graphs_.Replay(*graph, copies, rows.rows);
    }
  }
  std::vector<OwnedTensor> full;
  {
    TorchStreamScope torch_stream(stream, device_.spec().index);
    full = PooledInputs(called, use, full_rows, padded, inputs, stream);
  }
  ValidateInputs(called, full, nullptr);
  LaneRun how;
  how.bind_key = kPooledBindKey;
  how.bind = [&](Lane& lane) {
    MutexLock lanes(lanes_mutex_);
    lane.bound_key = kPooledBindKey;  // nothing to bind: every lane serves
  };
  how.owner = BatchGraphOwner(padded);
  how.in_place.assign(called.num_inputs, false);
  for (const PooledInput& t : source.tensors) how.in_place[t.input] = true;
  how.rows = padded > rows.rows ? rows.rows : -1;
  return RunOnLane(method, how, full, stream, key ? &*key : nullptr);
}

}  // namespace aoti_sessions
