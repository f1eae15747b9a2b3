// The engine facade: builds the rooms and forwards to them.
#include "engine.h"

#include "block_store.h"
#include "errors.h"
#include "pool_store.h"
#include "util.h"

namespace aoti_sessions {

std::shared_ptr<Engine> Engine::Create(const std::vector<MethodSource>& methods,
                                       const EngineOptions& options,
                                       std::shared_ptr<GraphHost> graph_host) {
  ValidateSources(methods);
  options.Validate();
  const uint64_t generation = ProcessGeneration();
  // Opened before the model loads them: the fingerprint is of the files loaded.
  ModelFingerprint fingerprint(methods);
  LoadedModel loaded = Model::Load(methods, options);
  auto parts = std::make_shared<EngineParts>();
  parts->model = loaded.model;
  // The one place that asks where sessions' state is kept.
  if (loaded.model->pool()) {
    parts->store = std::make_shared<PoolStore>(loaded.model, options.memory_budget);
  } else {
    parts->store = std::make_shared<BlockStore>(loaded.model);
  }
  parts->files = std::make_shared<SessionFiles>(loaded.model, fingerprint.Get());
  auto runner = std::make_shared<Runner>(loaded.model, std::move(loaded.lanes), options,
                                         std::move(graph_host));
  parts->runner = runner;
  // The residency tells the runner when a state leaves its block; weakly, so
  // neither room owns the other.
  parts->residency = Residency::Create(
      loaded.model, parts->store, options,
      [weak = std::weak_ptr<Runner>(runner)](const SessionState& state) {
        if (auto r = weak.lock()) r->Forget(state);
      });
  parts->process_generation = generation;
  return std::shared_ptr<Engine>(new Engine(std::move(parts)));
}

Engine::~Engine() {
  if (parts_->in_forked_child()) {
    // See ~Session: nothing of the parent's engine is touched in a child.
    new std::shared_ptr<const EngineParts>(std::move(parts_));
  }
}

const DeviceSpec& Engine::device() const { return parts_->model->device().spec(); }

std::vector<std::string> Engine::method_names() const { return parts_->model->method_names(); }

size_t Engine::method_index(const std::string& name) const {
  return parts_->model->method_index(name);
}

const std::pair<std::string, std::string>& Engine::call_spec(size_t method) const {
  return parts_->model->method(method).call_spec;
}

size_t Engine::num_inputs(size_t method) const { return parts_->model->method(method).num_inputs; }

bool Engine::captures(size_t method) const {
  parts_->model->method(method);  // checks the index
  return parts_->runner->Captures(method);
}

const std::vector<MutableBuffer>& Engine::mutable_buffers() const {
  return parts_->model->buffers();
}

size_t Engine::buffer_index(const std::string& fqn) const {
  return parts_->model->buffer_index(fqn);
}

size_t Engine::bytes_per_session() const { return parts_->model->block_bytes(); }

const std::optional<PoolLayout>& Engine::pool() const { return parts_->model->pool(); }

std::vector<OwnedTensor> Engine::RunBatch(const std::vector<std::shared_ptr<Session>>& rows,
                                          size_t method, std::vector<OwnedTensor>&& inputs,
                                          StreamHandle stream) {
  parts_->CheckProcess();
  // Session::RunBatch checks every row is of the first one's engine.
  if (!rows.empty() && rows[0] != nullptr && !rows[0]->BelongsTo(*parts_)) {
    Throw(ErrorKind::kInvalidArgument,
          "session " + std::to_string(rows[0]->id()) + " belongs to another engine");
  }
  return Session::RunBatch(rows, method, std::move(inputs), stream);
}

size_t Engine::weight_bytes() const { return parts_->model->weight_bytes(); }

size_t Engine::template_bytes() const { return parts_->model->template_bytes(); }

std::vector<WeightInfo> Engine::weights() const { return parts_->model->weight_infos(); }

const std::vector<std::string>& Engine::load_notes() const { return parts_->model->load_notes(); }

MemoryReport Engine::memory_report() const {
  parts_->CheckProcess();
  const Model& model = *parts_->model;
  MemoryReport report;
  report.weights = model.weight_bytes();
  report.templates = model.template_bytes();
  // A closed engine has released its containers, with their own state copy.
  report.containers =
      model.parking_bytes() + (parts_->runner->closed() ? 0 : model.container_state_bytes());
  parts_->residency->AddMemory(report);
  report.pool = parts_->store->allocated_bytes();
  return report;
}

EngineStats Engine::stats() const {
  parts_->CheckProcess();
  EngineStats stats;
  parts_->residency->AddStats(stats);
  parts_->runner->AddStats(stats);
  parts_->files->AddStats(stats);
  parts_->store->AddStats(stats);
  return stats;
}

void Engine::UpdateWeights(const std::vector<WeightUpdate>& updates, bool double_buffer) {
  parts_->CheckProcess();
  parts_->runner->UpdateWeights(updates, double_buffer);
}

std::shared_ptr<Session> Engine::NewSession(StreamHandle stream) {
  parts_->CheckProcess();
  return Session::New(parts_, nullptr, stream);
}

std::shared_ptr<Session> Engine::LoadSession(const std::string& path, bool strict,
                                             StreamHandle stream, std::string* attachment) {
  parts_->CheckProcess();
  if (closed()) Throw(ErrorKind::kSessionClosed, "the engine is closed");
  // The header is checked before anything is allocated, every byte before a
  // session is made.
  SessionFiles::CheckedFile file = parts_->store->CheckFile(*parts_->files, path, strict);
  if (attachment != nullptr) *attachment = file.attachment;
  auto session = Session::New(parts_, &file, stream);
  parts_->files->CountLoad();
  return session;
}

void Engine::Close() {
  parts_->CheckProcess();
  std::exception_ptr first;
  try {
    parts_->residency->Close();
  } catch (...) {
    first = std::current_exception();
  }
  parts_->runner->Close();
  if (first) std::rethrow_exception(first);
}

bool Engine::closed() const {
  parts_->CheckProcess();
  return parts_->residency->closed();
}

}  // namespace aoti_sessions
