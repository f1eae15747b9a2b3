// The run path of pooled methods (docs/batching.md), phase by phase: the
// caller's inputs checked, the rows addressed (page table, positions, slots,
// padded to a graph bucket), then a replay of the bucket's graph or a run on
// a lane with the inputs as the model takes them (the caller's padded, the
// pool's tensors, the addressing), whose outputs keep the real rows.
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

// Pages between two widths a run's page table may take (a method with a
// dynamic width reads only the pages its rows hold: fewer shapes, less
// waste). Also the narrowest table passed (up to max_pages): an export's
// dynamic width is at least 2.
constexpr int64_t kWidthStep = 4;

// The page-table width of a run: the method's, or (dynamic) the pages its
// longest row holds, rounded up to kWidthStep.
int64_t PageTableWidth(const Method& method, const PoolLayout& layout,
                       const std::vector<const PoolShare*>& shares) {
  const PoolSource& source = *method.pool;
  if (!source.page_table) return 0;
  const int64_t fixed = (*method.inputs)[*source.page_table].sizes[1];
  if (fixed > 0) return fixed;
  int64_t most = 1;
  for (const PoolShare* share : shares) {
    most = std::max(most, static_cast<int64_t>(share->pages.size()));
  }
  return std::min(layout.max_pages, (most + kWidthStep - 1) / kWidthStep * kWidthStep);
}

// One input of the addressing a method takes: which, its shape and its
// host data.
struct AddressingInput {
  size_t input;
  const char* dtype;
  std::vector<int64_t> sizes;
  const void* data;
  size_t bytes;
};

std::vector<AddressingInput> AddressingInputs(const PoolSource& source, const PoolRows& rows) {
  std::vector<AddressingInput> out;
  if (source.page_table) {
    out.push_back({*source.page_table, "int32", {rows.padded, rows.width}, rows.page_table.data(),
                   rows.page_table.size() * sizeof(int32_t)});
  }
  if (source.positions) {
    out.push_back({*source.positions, "int64", {rows.padded}, rows.positions.data(),
                   rows.positions.size() * sizeof(int64_t)});
  }
  if (source.slot_ids) {
    out.push_back({*source.slot_ids, "int32", {rows.padded}, rows.slot_ids.data(),
                   rows.slot_ids.size() * sizeof(int32_t)});
  }
  return out;
}

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

std::vector<OwnedTensor> Runner::RunPooled(size_t method, StatePool& pool,
                                           const std::vector<const PoolShare*>& shares,
                                           std::vector<OwnedTensor>&& inputs,
                                           StreamHandle stream) {
  const Method& called = model_->method(method);
  const std::vector<std::vector<int64_t>> sizes =
      CheckBatch(called, static_cast<int64_t>(shares.size()), inputs);
  const bool captures = graphs_.Captures(method);
  const PoolRows rows = AddressRows(called, pool, shares, captures);
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
    key = BatchKey(called, use, rows, sizes, stream);
    if (Graph* graph = graphs_.Find(BatchGraphOwner(rows.padded), method, *key)) {
      return ReplayBatch(*graph, called, rows, inputs);
    }
  }
  std::vector<OwnedTensor> full;
  {
    TorchStreamScope torch_stream(stream, device_.spec().index);
    full = BatchInputs(called, use, rows, inputs, stream);
  }
  ValidateInputs(called, full, nullptr);
  return RunBatchOnLane(method, rows, full, stream, key ? &*key : nullptr);
}

std::vector<std::vector<int64_t>> Runner::CheckBatch(const Method& called, int64_t rows,
                                                     std::vector<OwnedTensor>& inputs) const {
  // (Session::RunBatch refuses a method without a pool before it gets here.)
  const PoolSource& source = called.pool.value();
  if (inputs.size() != called.caller_inputs.size()) {
    Throw(ErrorKind::kInvalidArgument,
          "method '" + called.name + "' takes " + std::to_string(called.caller_inputs.size()) +
              " tensor inputs besides the pooled state, got " + std::to_string(inputs.size()));
  }
  if (rows < 1 || rows > source.max_rows) {
    Throw(ErrorKind::kInvalidArgument, "method '" + called.name + "' takes 1 to " +
                                           std::to_string(source.max_rows) +
                                           " sessions in one call, got " + std::to_string(rows));
  }
  std::vector<std::vector<int64_t>> sizes;
  for (size_t k = 0; k < inputs.size(); ++k) {
    sizes.push_back(ValidateInput(called, called.caller_inputs[k], inputs[k]));
    if (sizes.back().empty() || sizes.back()[0] != rows) {
      Throw(ErrorKind::kInvalidArgument,
            "input " + std::to_string(called.caller_inputs[k]) + " of method '" + called.name +
                "' has " + (sizes.back().empty() ? std::string("no rows") : std::to_string(sizes.back()[0]) + " rows") +
                "; the batch has " + std::to_string(rows) + " sessions");
    }
  }
  return sizes;
}

PoolRows Runner::AddressRows(const Method& called, const StatePool& pool,
                             const std::vector<const PoolShare*>& shares, bool captures) const {
  const PoolSource& source = *called.pool;
  PoolRows rows;
  rows.rows = static_cast<int64_t>(shares.size());
  rows.padded = std::max(source.min_rows,
                         captures ? BatchBucket(rows.rows, source.max_rows) : rows.rows);
  rows.width = PageTableWidth(called, pool.layout(), shares);
  // A captured method whose page table has a dynamic width gets it bucketed
  // (entries past a session's pages are the zero page, as at any width).
  if (captures && source.page_table && (*called.inputs)[*source.page_table].sizes[1] < 0) {
    rows.width = WidthBucket(rows.width, pool.layout().max_pages);
  }
  // Padding rows write the scratch page and slot (slot 0), and read nothing
  // of a session's.
  const auto width = static_cast<size_t>(rows.width);
  const auto padded = static_cast<size_t>(rows.padded);
  if (source.page_table) {
    rows.page_table.resize(padded * width);
    for (size_t r = 0; r < padded; ++r) {
      int32_t* row = rows.page_table.data() + r * width;
      if (r < shares.size()) {
        pool.FillPageRow(*shares[r], row, width);
      } else {
        pool.FillPaddingRow(row, width);
      }
    }
  }
  for (const PoolShare* share : shares) {
    if (source.positions) rows.positions.push_back(share->length);
    if (source.slot_ids) rows.slot_ids.push_back(share->slot);
  }
  if (source.positions) rows.positions.resize(padded, 0);
  if (source.slot_ids) rows.slot_ids.resize(padded, StatePool::kScratchSlot);
  return rows;
}

GraphKey Runner::BatchKey(const Method& called, const StatePool::Use& use, const PoolRows& rows,
                          const std::vector<std::vector<int64_t>>& sizes,
                          StreamHandle stream) const {
  const PoolSource& source = *called.pool;
  GraphKey key{use.epoch(), weights_epoch_, stream, {}};
  // The key's shapes, in input order, without building the inputs.
  std::vector<std::vector<int64_t>> shapes(called.num_inputs);
  for (size_t k = 0; k < sizes.size(); ++k) {
    shapes[called.caller_inputs[k]] = sizes[k];
    shapes[called.caller_inputs[k]][0] = rows.padded;
  }
  std::vector<OwnedTensor> pooled = use.Tensors();
  for (size_t t = 0; t < source.tensors.size(); ++t) {
    shapes[source.tensors[t].input] = ReadLayout(pooled[called.pool_tensors[t]].get()).sizes;
  }
  for (const AddressingInput& a : AddressingInputs(source, rows)) shapes[a.input] = a.sizes;
  for (const auto& s : shapes) AppendShapeKey(key.shapes, s);
  return key;
}

std::vector<OwnedTensor> Runner::ReplayBatch(Graph& graph, const Method& called,
                                             const PoolRows& rows,
                                             const std::vector<OwnedTensor>& inputs) {
  std::vector<GraphInput> copies(called.num_inputs);
  for (size_t k = 0; k < inputs.size(); ++k) {
    copies[called.caller_inputs[k]] = {DataPtr(inputs[k].get()),
                                       ReadLayout(inputs[k].get()).span_bytes()};
  }
  for (const AddressingInput& a : AddressingInputs(*called.pool, rows)) {
    copies[a.input] = {a.data, a.bytes};
  }
  return graphs_.Replay(graph, copies, rows.rows);
}

std::vector<OwnedTensor> Runner::BatchInputs(const Method& method, const StatePool::Use& use,
                                             const PoolRows& rows,
                                             std::vector<OwnedTensor>& inputs,
                                             StreamHandle stream) const {
  const PoolSource& source = *method.pool;
  std::vector<OwnedTensor> full(method.num_inputs);
  for (size_t k = 0; k < method.caller_inputs.size(); ++k) {
    OwnedTensor& input = inputs[k];
    if (rows.padded == rows.rows) {
      full[method.caller_inputs[k]] = std::move(input);
      continue;
    }
    TensorLayout layout = ReadLayout(input.get());
    const size_t bytes = layout.span_bytes();
    layout.sizes[0] = rows.padded;
    layout = Contiguous(layout.dtype, layout.sizes);
    full[method.caller_inputs[k]] = Filled(device_, layout, DataPtr(input.get()), bytes, stream);
  }
  std::vector<OwnedTensor> pooled = use.Tensors();
  for (size_t t = 0; t < source.tensors.size(); ++t) {
    full[source.tensors[t].input] = OwnedTensor::Alias(pooled[method.pool_tensors[t]].get());
  }
  for (const AddressingInput& a : AddressingInputs(source, rows)) {
    full[a.input] = Filled(device_, Contiguous(DtypeFromName(a.dtype), a.sizes), a.data, a.bytes,
                           stream);
  }
  return full;
}

std::vector<OwnedTensor> Runner::RunBatchOnLane(size_t method, const PoolRows& rows,
                                                std::vector<OwnedTensor>& full,
                                                StreamHandle stream, GraphKey* key) {
  const Method& called = model_->method(method);
  LaneRun how;
  how.bind_key = kPooledBindKey;
  how.bind = [&](Lane& lane) {
    MutexLock lanes(lanes_mutex_);
    lane.bound_key = kPooledBindKey;  // nothing to bind: every lane serves
  };
  how.owner = BatchGraphOwner(rows.padded);
  how.in_place.assign(called.num_inputs, false);
  for (const PooledInput& t : called.pool->tensors) how.in_place[t.input] = true;
  how.rows = rows.padded > rows.rows ? rows.rows : -1;
  return RunOnLane(method, how, full, stream, key);
}

}  // namespace aoti_sessions
