// The model: everything an engine loads once and never changes afterwards.
// Its methods (what calling each takes, where its state and weights bind), the
// descriptors and block layout of the mutable state, the templates of its
// initial value, and the weights, held once for every method. The method
// containers are made here too, but handed to the runner, which alone calls
// them after load.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "container.h"
#include "device.h"
#include "options.h"
#include "torch_shim.h"
#include "weights.h"

namespace aoti_sessions {

// One pooled tensor of the engine (docs/batching.md): `[units, ...unit sizes]`.
struct PooledTensor {
  std::string name;
  PoolKind kind = PoolKind::kPages;
  TensorLayout unit;  // one unit (a page or a slot), contiguous
  size_t unit_bytes = 0;
};

// The pooled state every pooled method agrees on.
struct PoolLayout {
  int64_t page_size = 0;
  int64_t max_pages = 0;  // page-table width: a session holds at most max_pages * page_size positions
  int64_t max_rows = 1;   // the most rows any method takes in one call
  std::vector<PooledTensor> tensors;  // in order of first appearance
  size_t page_bytes = 0;  // one page of every page tensor
  size_t slot_bytes = 0;  // one slot of every slot tensor
  bool has_pages() const { return max_pages > 0; }
  bool has_slots() const { return slot_bytes > 0; }
  int64_t max_positions() const { return max_pages * page_size; }
  // Pages that hold `positions` positions.
  size_t PagesFor(int64_t positions) const;
  // A session's units packed (offload, save, state()): each pooled tensor's
  // units in turn (a page tensor's pages in order, a slot tensor's slot).
  // Its bytes for `pages` pages, and where each tensor's part starts.
  size_t PackedBytes(size_t pages) const { return pages * page_bytes + slot_bytes; }
  std::vector<size_t> PackedOffsets(size_t pages) const;
  // The layout of pooled tensor `tensor`'s units of a session holding `pages`
  // pages: [pages or 1 slot, ...unit], contiguous (state(), session files).
  TensorLayout SessionLayout(size_t tensor, size_t pages) const;
  // Lays out pooled method `method`'s pool (`source` over its recorded
  // `inputs`) into this layout: its page-table width, page size and every
  // pooled tensor's unit must agree with the methods laid out before it (the
  // rules across methods; PoolSource::Validate has one method's). Throws
  // kPackage naming both methods. Returns the index in `tensors` of each of
  // source.tensors.
  std::vector<size_t> Add(const std::string& method, const PoolSource& source,
                          const std::vector<InputSpec>& inputs);
  std::string from;  // the first method laid out
};

// One method as loaded.
struct Method {
  std::string name;
  std::string library_path;
  std::string cubin_dir;
  std::optional<WeightsFile> weights_file;
  std::optional<std::vector<InputSpec>> inputs;
  std::shared_ptr<ProxyExecutor> proxy;  // its containers' proxy executor (null: none)
  std::pair<std::string, std::string> call_spec;  // pytree (in, out) specs as JSON
  size_t num_inputs = 0;
  // (buffer index, internal constant name) for every mutable FQN it has.
  std::vector<std::pair<size_t, std::string>> state_bindings;
  // (held weight, internal constant name) for every weight it reads.
  std::vector<std::pair<HeldWeight*, std::string>> weight_bindings;
  // Its container's blob holds weights the engine adopted: never freed.
  bool keeps_own_constants = false;
  // How it addresses the pooled state (pooled methods only), and the index in
  // PoolLayout::tensors of each of pool->tensors.
  std::optional<PoolSource> pool;
  std::vector<size_t> pool_tensors;
  // Inputs the caller gives (all but the pool's), in input order.
  std::vector<size_t> caller_inputs;
};

// The weights a tensor is to be bound to for each, in a weight update.
using WeightTensors = std::unordered_map<const HeldWeight*, AtenTensorHandle>;

// (internal name, tensor) pairs of the method's weights: every weight with its
// held tensor or, with `only`, just the weights in it, with their tensors there.
std::vector<AOTInductorConstantMapEntry> WeightPairs(const Method& method,
                                                     const WeightTensors* only = nullptr);

class Model;

// Containers of one method (its lanes), all bound to the held weights.
using Lanes = std::vector<std::unique_ptr<Container>>;

// What loading makes: the model, and the lanes of each method (in method
// order) for the runner.
struct LoadedModel {
  std::shared_ptr<Model> model;
  std::vector<Lanes> lanes;
};

class Model {
 public:
  // Loads every method, selects the mutable state, holds each weight once and
  // captures the templates, before any run. Throws kPackage (unloadable or
  // inconsistent model) or kInvalidArgument (bad options); nothing stays
  // allocated.
  static LoadedModel Load(const std::vector<MethodSource>& sources, const EngineOptions& options);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  Device& device() const { return *device_; }
  const std::vector<Method>& methods() const { return methods_; }
  // The method at `index`; throws kInvalidArgument when out of range.
  const Method& method(size_t index) const;
  // Index of a method by name; throws kInvalidArgument naming the methods.
  size_t method_index(const std::string& name) const;
  std::vector<std::string> method_names() const;

  const std::vector<MutableBuffer>& buffers() const { return buffers_; }
  // The pooled state, if any method declares one (then there are no buffers).
  const std::optional<PoolLayout>& pool() const { return pool_; }
  // Index of a mutable FQN; throws kInvalidArgument if it is not one.
  size_t buffer_index(const std::string& fqn) const;
  bool is_mutable(const std::string& fqn) const { return buffer_index_.count(fqn) > 0; }
  // Bytes of one session's state block (all buffers, 256-byte aligned).
  size_t block_bytes() const { return block_bytes_; }
  // Queues the initial state into `block` (a session block) on `stream`.
  void InitializeBlock(void* block, StreamHandle stream) const;
  // One tensor per buffer aliasing `block` (a session block on the device).
  std::vector<OwnedTensor> AliasTensors(void* block) const;

  // Held weights. The runner, under its run lock, is the only writer of their
  // memory after load (UpdateWeights).
  WeightStore& weights() const { return *weights_; }
  std::vector<WeightInfo> weight_infos() const;
  // Bytes of weights held (each distinct weight once, whatever the methods).
  size_t weight_bytes() const { return weights_->held_bytes(); }
  size_t template_bytes() const { return template_bytes_; }
  // Device bytes containers hold beyond the shared weights: the parking
  // buffers, and the state copy inside a container whose blob was adopted.
  size_t parking_bytes() const { return parking_bytes_; }
  size_t container_state_bytes() const { return container_state_bytes_; }
  // What loading noticed and decided (e.g. weights kept apart because methods
  // disagree on them); the Python layer logs these.
  const std::vector<std::string>& load_notes() const { return load_notes_; }

 private:
  // Initial value of a mutable constant, on the device or in host memory.
  struct InitialValue {
    TensorLayout layout;
    const void* data = nullptr;
  };

  Model() = default;
  std::vector<std::unique_ptr<Container>> OpenMethods(const std::vector<MethodSource>& sources,
                                                      const EngineOptions& options);
  void SelectMutable(const std::vector<std::unique_ptr<Container>>& containers,
                     const EngineOptions& options);
  void CaptureTemplates(const std::vector<std::unique_ptr<Container>>& containers);
  void LayOutBlock(const std::vector<const void*>& initial);
  // Builds pool_ from the pooled methods; throws kPackage where they disagree.
  void LayOutPool();

  // model_weights.cc: binds every method's weights to one held copy each
  // (loading weights files, adopting or copying embedded ones).
  void HoldWeights(const std::vector<std::unique_ptr<Container>>& containers, bool strict);
  // The held copy of weight `c` of `method`: one already held with the same
  // layout and content, or a new one read from its weights file / copied or
  // (`adopt`) adopted from the container's `current` constants.
  HeldWeight* HoldFromFile(const Method& method, const ConstantInfo& c, bool strict);
  HeldWeight* HoldEmbedded(const Method& method, const ConstantInfo& c,
                           const std::unordered_map<std::string, AtenTensorHandle>& current,
                           bool adopt, bool strict);
  // After the templates are captured: releases the blobs of containers whose
  // weights are now shared, and the host copies of initial values.
  void FinishWeights(const std::vector<std::unique_ptr<Container>>& containers);
  // Binds `container` (a new one of method `m`) to the held weights; its
  // mutable constants point at the parking memory until a session binds.
  void ShareWeights(size_t m, Container& container);
  // Allocates the parking memory (once).
  void EnsureParking();
  // The method containers of `first` (one per method), each with `count - 1`
  // more (model_weights.cc).
  std::vector<Lanes> MakeLanes(std::vector<std::unique_ptr<Container>> first, size_t count,
                               bool reclaim_bind_handles);
  std::unordered_map<std::string, InitialValue> InitialValues(const Method& method,
                                                              Container& container);
  // Records (or, with `strict`, refuses) a weight that differs between methods.
  void NoteDifferingWeight(const Method& method, const std::string& fqn, bool strict);

  std::unique_ptr<Device> device_;
  std::vector<Method> methods_;
  std::vector<MutableBuffer> buffers_;
  std::unordered_map<std::string, size_t> buffer_index_;
  std::optional<PoolLayout> pool_;
  size_t block_bytes_ = 0;
  std::unique_ptr<WeightStore> weights_;
  std::vector<std::string> load_notes_;
  // Initial values of mutable constants read from weights files (load only).
  std::unordered_map<std::string, std::vector<char>> file_initial_;
  // Templates of the buffers whose initial value is not all zero, laid out as
  // in a session block; those buffers come first, so they form one prefix.
  void* template_block_ = nullptr;
  size_t template_bytes_ = 0;
  size_t nonzero_prefix_bytes_ = 0;
  mutable StreamTracker template_stream_;  // streams that copied from the templates
  // Placeholder memory for the mutable constants of containers whose blob was
  // freed, until a session is bound (never read: runs bind a session first).
  void* parking_ = nullptr;
  size_t parking_bytes_ = 0;
  std::vector<OwnedTensor> parking_tensors_;
  size_t container_state_bytes_ = 0;
};

}  // namespace aoti_sessions
