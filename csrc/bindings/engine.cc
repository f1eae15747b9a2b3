// Engine, and the graph host it calls back into Python with.
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "common.h"

namespace aoti_sessions::bindings {

namespace {

// A GraphHost calling a Python object (aoti_sessions._graphs.TorchGraphHost),
// with the GIL taken for each call (the core calls it from run threads that
// released the GIL).
class PyGraphHost final : public GraphHost {
 public:
  explicit PyGraphHost(py::object host) : host_(std::move(host)) {}
  ~PyGraphHost() override {
    if (!Py_IsInitialized()) {
      host_.release();  // the interpreter is gone: nothing to give back
      return;
    }
    py::gil_scoped_acquire gil;
    host_ = py::object();
  }

  Pool NewPool() override {
    return Checked("creating a CUDA graph memory pool",
                   [&] { return host_.attr("new_pool")().cast<Pool>(); });
  }
  void BeginAllocations(Pool pool, StreamHandle stream) override {
    Checked("routing allocations to a CUDA graph pool", [&] {
      host_.attr("begin")(AsTuple(pool), reinterpret_cast<uintptr_t>(stream));
    });
  }
  void EndAllocations(Pool pool) noexcept override {
    Quietly("end", [&] { host_.attr("end")(AsTuple(pool)); });
  }
  void ReleasePool(Pool pool) noexcept override {
    Quietly("release", [&] { host_.attr("release")(AsTuple(pool)); });
  }
  void Note(const std::string& note) noexcept override {
    Quietly("note", [&] { host_.attr("note")(note); });
  }

 private:
  // Every Python object is made in the calls below, under the GIL.
  static py::tuple AsTuple(Pool pool) { return py::make_tuple(pool.first, pool.second); }

  // Runs `call` under the GIL; a failure is a kRun Error saying what failed.
  template <typename Call>
  std::invoke_result_t<Call> Checked(const char* doing, Call call) {
    py::gil_scoped_acquire gil;
    try {
      return call();
    } catch (const std::exception& e) {
      Throw(ErrorKind::kRun, std::string(doing) + ": " + e.what());
    }
  }
  // Runs `call` under the GIL for a call without a result: a Python error is
  // reported as unraisable, nothing propagates.
  template <typename Call>
  void Quietly(const char* name, Call call) noexcept {
    if (!Py_IsInitialized()) return;
    py::gil_scoped_acquire gil;
    try {
      call();
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable(name);
    } catch (...) {
      // Nothing to report to: the call has no result.
    }
  }

  py::object host_;
};

}  // namespace

void BindEngine(py::module_& m) {
  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
      .def(py::init([](const std::vector<MethodSource>& methods, const EngineOptions& options,
                       py::object graph_host) {
             std::shared_ptr<GraphHost> host;
             if (!graph_host.is_none()) host = std::make_shared<PyGraphHost>(std::move(graph_host));
             py::gil_scoped_release release;
             return Engine::Create(methods, options, std::move(host));
           }),
           py::arg("methods"), py::arg("options"), py::arg("graph_host") = py::none(),
           "graph_host: an object with new_pool(), begin(pool, stream), end(pool), "
           "release(pool) and note(text), routing torch's allocations during CUDA graph "
           "captures (aoti_sessions._graphs); None: CUDA engines run eagerly.")
      .def_property_readonly("device", [](const Engine& e) { return e.device().ToString(); })
      .def_property_readonly("method_names", &Engine::method_names)
      .def("method_index", &Engine::method_index, py::arg("name"))
      .def("call_spec", &Engine::call_spec, py::arg("method"))
      .def("num_inputs", &Engine::num_inputs, py::arg("method"))
      .def("captures", &Engine::captures, py::arg("method"),
           "Whether the method's runs are captured into CUDA graphs.")
      .def_property_readonly("mutable_buffers", &Engine::mutable_buffers)
      .def_property_readonly("bytes_per_session", &Engine::bytes_per_session)
      .def_property_readonly("weight_bytes", &Engine::weight_bytes)
      .def_property_readonly("template_bytes", &Engine::template_bytes)
      .def_property_readonly("load_notes", &Engine::load_notes)
      .def("memory_report", &Engine::memory_report, py::call_guard<py::gil_scoped_release>())
      .def("weights", &Engine::weights)
      .def(
          "update_weights",
          [](Engine& e, const std::vector<std::string>& names, const CapsuleList& sources,
             bool double_buffer) {
            std::vector<OwnedTensor> owned = TakeHandles(sources);
            if (owned.size() != names.size()) {
              throw py::value_error("update_weights: names and tensors differ in number");
            }
            std::vector<WeightUpdate> updates;
            for (size_t i = 0; i < names.size(); ++i) updates.push_back({names[i], owned[i].get()});
            py::gil_scoped_release release;
            e.UpdateWeights(updates, double_buffer);
          },
          py::arg("names"), py::arg("sources"), py::arg("double_buffer") = false)
      .def("stats", &Engine::stats, py::call_guard<py::gil_scoped_release>())
      .def(
          "new_session", [](Engine& e, uintptr_t stream) { return e.NewSession(ToStream(stream)); },
          py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "load_session",
          [](Engine& e, const std::string& path, bool strict, uintptr_t stream) {
            return e.LoadSession(path, strict, ToStream(stream));
          },
          py::arg("path"), py::arg("strict") = true, py::arg("stream") = 0,
          py::call_guard<py::gil_scoped_release>())
      .def(
          "load_session_attached",
          [](Engine& e, const std::string& path, bool strict, uintptr_t stream) {
            std::string attachment;
            std::shared_ptr<Session> session;
            {
              py::gil_scoped_release release;
              session = e.LoadSession(path, strict, ToStream(stream), &attachment);
            }
            return py::make_tuple(session, py::bytes(attachment));
          },
          py::arg("path"), py::arg("strict") = true, py::arg("stream") = 0,
          "(session, attachment): a loaded session and the bytes saved with it (b'' for none).")
      .def_property_readonly("pool", &Engine::pool, "The pooled state's layout, or None.")
      .def(
          "run_batch",
          [](Engine& e, const std::vector<std::shared_ptr<Session>>& rows, size_t method,
             const CapsuleList& inputs, uintptr_t stream) {
            std::vector<OwnedTensor> owned = TakeHandles(inputs);
            std::vector<OwnedTensor> outputs;
            {
              py::gil_scoped_release release;
              outputs = e.RunBatch(rows, method, std::move(owned), ToStream(stream));
            }
            return GiveHandles(std::move(outputs));
          },
          py::arg("rows"), py::arg("method"), py::arg("inputs"), py::arg("stream") = 0,
          "Runs pooled `method` once over `rows` (one session each, in order).")
      .def("close", &Engine::Close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &Engine::closed);
}

}  // namespace aoti_sessions::bindings
