// pybind11 module `aoti_sessions._core`: a thin layer over the core. It checks
// argument types, moves tensor handles in and out as capsules (made and consumed
// by torch._C._aoti), releases the GIL around every call that may block or run
// the model, and maps core errors to the exception classes of
// aoti_sessions.errors. The documented API is python/aoti_sessions.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/typing.h>

#include <cstdint>

#include "../core/engine.h"
#include "../core/errors.h"
#include "../core/session.h"

namespace py = pybind11;
using namespace aoti_sessions;

// Typed containers, so the generated stubs say what crosses the boundary.
using CapsuleList = py::typing::List<py::capsule>;
using InfoDict = py::typing::Dict<py::str, py::object>;

namespace {

StreamHandle ToStream(uintptr_t stream) { return reinterpret_cast<StreamHandle>(stream); }

// Takes ownership of every handle in `capsules` (as made by
// torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors), so none leaks if one of
// them is not a capsule.
std::vector<OwnedTensor> TakeHandles(const py::list& capsules) {
  std::vector<OwnedTensor> owned;
  owned.reserve(capsules.size());
  bool bad = false;
  for (py::handle item : capsules) {
    if (!PyCapsule_CheckExact(item.ptr())) {
      bad = true;
      continue;
    }
    void* ptr = PyCapsule_GetPointer(item.ptr(), PyCapsule_GetName(item.ptr()));
    if (ptr == nullptr) throw py::error_already_set();
    owned.emplace_back(static_cast<AtenTensorHandle>(ptr));
  }
  if (bad) throw py::type_error("expected a list of tensor handle capsules");
  return owned;
}

CapsuleList GiveHandles(std::vector<OwnedTensor>&& tensors) {
  CapsuleList out;
  for (OwnedTensor& t : tensors) {
    // Unnamed, without destructor: the form alloc_tensors_by_stealing_from_void_ptrs takes.
    PyObject* capsule = PyCapsule_New(static_cast<void*>(t.get()), nullptr, nullptr);
    if (capsule == nullptr) throw py::error_already_set();
    out.append(py::reinterpret_steal<py::object>(capsule));
    t.release();
  }
  return out;
}

py::object ErrorClass(const char* name) {
  return py::module_::import("aoti_sessions.errors").attr(name);
}

void TranslateError(const Error& e) {
  const char* name = nullptr;
  switch (e.kind()) {
    case ErrorKind::kInvalidArgument:
      PyErr_SetString(PyExc_ValueError, e.what());
      return;
    case ErrorKind::kTypeMismatch:
      PyErr_SetString(PyExc_TypeError, e.what());
      return;
    case ErrorKind::kPackage: name = "PackageError"; break;
    case ErrorKind::kCapacity: name = "CapacityError"; break;
    case ErrorKind::kSessionClosed: name = "SessionClosedError"; break;
    case ErrorKind::kRun: name = "RunError"; break;
    case ErrorKind::kDevice: name = "DeviceError"; break;
    case ErrorKind::kSessionFile: name = "SessionFileError"; break;
    case ErrorKind::kFileNotFound: name = "SessionFileNotFoundError"; break;
    case ErrorKind::kModelMismatch: name = "ModelMismatchError"; break;
    case ErrorKind::kInternal: name = "Error"; break;
  }
  PyErr_SetString(ErrorClass(name).ptr(), e.what());
}

InfoDict BufferDict(const MutableBuffer& b) {
  InfoDict d;
  d["fqn"] = b.fqn;
  d["dtype"] = DtypeName(b.layout.dtype);
  d["sizes"] = b.layout.sizes;
  d["strides"] = b.layout.strides;
  d["bytes"] = b.bytes;
  d["zero_initial"] = b.zero_initial;
  d["methods"] = b.methods;
  return d;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "C++ core of aoti_sessions (private; use the aoti_sessions package)";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      TranslateError(e);
    }
  });

  m.def(
      "built_with_cuda",
      [] {
#ifdef AOTI_SESSIONS_WITH_CUDA
        return true;
#else
        return false;
#endif
      },
      "Whether this build serves CUDA engines.");
  m.def("dtype_code", &DtypeFromName, py::arg("name"),
        "Shim dtype code of a torch dtype name ('float32'), -1 if unknown.");

  py::class_<InputSpec>(m, "InputSpec")
      .def(py::init<>())
      .def_readwrite("dtype", &InputSpec::dtype)
      .def_readwrite("sizes", &InputSpec::sizes)
      .def_readwrite("strides", &InputSpec::strides);

  py::class_<MethodSource>(m, "MethodSource")
      .def(py::init<>())
      .def_readwrite("name", &MethodSource::name)
      .def_readwrite("library_path", &MethodSource::library_path)
      .def_readwrite("cubin_dir", &MethodSource::cubin_dir)
      .def_readwrite("inputs", &MethodSource::inputs)
      .def(
          "set_weights_file",
          [](MethodSource& s, const std::string& path,
             const std::vector<std::tuple<std::string, int32_t, std::vector<int64_t>,
                                          std::vector<int64_t>, uint64_t, uint64_t>>& entries) {
            WeightsFile file;
            file.path = path;
            for (const auto& [fqn, dtype, sizes, strides, offset, bytes] : entries) {
              WeightEntry e;
              e.fqn = fqn;
              e.layout.dtype = dtype;
              e.layout.sizes = sizes;
              e.layout.strides = strides;
              e.offset = offset;
              e.bytes = bytes;
              file.entries.push_back(std::move(e));
            }
            s.weights = std::move(file);
          },
          py::arg("path"), py::arg("entries"),
          "Weights of a library compiled without them: (fqn, dtype code, sizes, strides, "
          "offset, bytes) per tensor of the file at `path`.");

  py::class_<Session, std::shared_ptr<Session>>(m, "Session")
      .def_property_readonly("id", &Session::id)
      .def_property_readonly("closed", &Session::closed)
      .def_property_readonly(
          "address",
          [](const Session& s) {
            py::gil_scoped_release release;  // waits for a run of this session in flight
            return reinterpret_cast<uintptr_t>(s.address());
          },
          "Device address of the session's state block (0 once closed or offloaded).")
      .def_property_readonly("resident", &Session::resident)
      .def_property_readonly(
          "last_use", [](const Session& s) { return static_cast<double>(s.last_use_ns()) * 1e-9; },
          "Last use, in seconds of time.monotonic().")
      .def(
          "offload", [](Session& s, uintptr_t stream) { s.Offload(ToStream(stream)); },
          py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "restore", [](Session& s, uintptr_t stream) { s.Restore(ToStream(stream)); },
          py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "save",
          [](Session& s, const std::string& path, uintptr_t stream) { s.Save(path, ToStream(stream)); },
          py::arg("path"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "run",
          [](Session& s, size_t method, const CapsuleList& inputs, uintptr_t stream) {
            std::vector<OwnedTensor> owned = TakeHandles(inputs);
            std::vector<OwnedTensor> outputs;
            {
              py::gil_scoped_release release;
              outputs = s.Run(method, std::move(owned), ToStream(stream));
            }
            return GiveHandles(std::move(outputs));
          },
          py::arg("method"), py::arg("inputs"), py::arg("stream") = 0)
      .def(
          "reset", [](Session& s, uintptr_t stream) { s.Reset(ToStream(stream)); },
          py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "fork", [](Session& s, uintptr_t stream) { return s.Fork(ToStream(stream)); },
          py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "read_buffer",
          [](Session& s, size_t buffer, const py::capsule& dst, uintptr_t stream) {
            std::vector<OwnedTensor> owned = TakeHandles(py::list(py::make_tuple(dst)));
            py::gil_scoped_release release;
            s.ReadBuffer(buffer, owned[0].get(), ToStream(stream));
          },
          py::arg("buffer"), py::arg("dst"), py::arg("stream") = 0)
      .def(
          "write_buffers",
          [](Session& s, const CapsuleList& sources, uintptr_t stream) {
            std::vector<OwnedTensor> owned = TakeHandles(sources);
            std::vector<AtenTensorHandle> handles;
            for (auto& t : owned) handles.push_back(t.get());
            py::gil_scoped_release release;
            s.WriteBuffers(handles, ToStream(stream));
          },
          py::arg("sources"), py::arg("stream") = 0)
      .def("close", &Session::Close, py::call_guard<py::gil_scoped_release>());

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
      .def(py::init([](const std::vector<MethodSource>& methods, const std::string& device,
                       std::optional<std::vector<std::string>> mutable_patterns,
                       std::vector<std::string> known_mutated, int64_t max_sessions,
                       int64_t memory_budget, bool reclaim_bind_handles, bool strict_weights,
                       int64_t host_budget, double idle_timeout, bool idle_close) {
             EngineOptions options;
             options.device = device;
             options.mutable_patterns = std::move(mutable_patterns);
             options.known_mutated = std::move(known_mutated);
             options.max_sessions = max_sessions;
             options.memory_budget = memory_budget;
             options.reclaim_bind_handles = reclaim_bind_handles;
             options.strict_weights = strict_weights;
             options.host_budget = host_budget;
             options.idle_timeout_seconds = idle_timeout;
             options.idle_close = idle_close;
             py::gil_scoped_release release;
             return Engine::Create(methods, options);
           }),
           py::arg("methods"), py::arg("device"), py::arg("mutable_patterns"),
           py::arg("known_mutated"), py::arg("max_sessions") = -1,
           py::arg("memory_budget") = -1, py::arg("reclaim_bind_handles") = true,
           py::arg("strict_weights") = false, py::arg("host_budget") = -1,
           py::arg("idle_timeout") = 0.0, py::arg("idle_close") = false)
      .def_property_readonly("device", [](const Engine& e) { return e.device().ToString(); })
      .def_property_readonly("method_names", &Engine::method_names)
      .def("method_index", &Engine::method_index, py::arg("name"))
      .def("call_spec", &Engine::call_spec, py::arg("method"))
      .def("num_inputs", &Engine::num_inputs, py::arg("method"))
      .def_property_readonly("mutable_buffers",
                             [](const Engine& e) {
                               py::typing::List<InfoDict> out;
                               for (const auto& b : e.mutable_buffers()) out.append(BufferDict(b));
                               return out;
                             })
      .def_property_readonly("bytes_per_session", &Engine::bytes_per_session)
      .def_property_readonly("weight_bytes", &Engine::weight_bytes)
      .def_property_readonly("template_bytes", &Engine::template_bytes)
      .def_property_readonly("load_notes", &Engine::load_notes)
      .def("memory_report",
           [](const Engine& e) {
             MemoryReport r = e.memory_report();
             InfoDict d;
             d["weights"] = r.weights;
             d["templates"] = r.templates;
             d["sessions"] = r.sessions;
             d["containers"] = r.containers;
             d["offloaded"] = r.offloaded;
             d["host_spare"] = r.host_spare;
             return d;
           })
      .def("weights",
           [](const Engine& e) {
             py::typing::List<InfoDict> out;
             for (const auto& w : e.weights().all()) {
               InfoDict d;
               d["fqn"] = w->fqn;
               d["dtype"] = DtypeName(w->layout.dtype);
               d["sizes"] = w->layout.sizes;
               d["strides"] = w->layout.strides;
               d["bytes"] = w->bytes;
               d["methods"] = w->methods;
               out.append(d);
             }
             return out;
           })
      .def(
          "update_weights",
          [](Engine& e, const std::vector<std::string>& names, const CapsuleList& sources,
             bool double_buffer) {
            std::vector<OwnedTensor> owned = TakeHandles(sources);
            if (owned.size() != names.size()) {
              throw Error(ErrorKind::kInvalidArgument, "update_weights: names and tensors differ in number");
            }
            std::vector<WeightUpdate> updates;
            for (size_t i = 0; i < names.size(); ++i) updates.push_back({names[i], owned[i].get()});
            py::gil_scoped_release release;
            e.UpdateWeights(updates, double_buffer);
          },
          py::arg("names"), py::arg("sources"), py::arg("double_buffer") = false)
      .def("stats",
           [](const Engine& e) {
             EngineStats s = e.stats();
             InfoDict d;
             d["live_sessions"] = s.live_sessions;
             d["live_bytes"] = s.live_bytes;
             d["resident_sessions"] = s.resident_sessions;
             d["offloaded_sessions"] = s.offloaded_sessions;
             d["device_bytes"] = s.device_bytes;
             d["host_bytes"] = s.host_bytes;
             d["host_spare_bytes"] = s.host_spare_bytes;
             d["sessions_created"] = s.sessions_created;
             d["offloads"] = s.offloads;
             d["evictions"] = s.evictions;
             d["idle_offloads"] = s.idle_offloads;
             d["idle_closes"] = s.idle_closes;
             d["restores"] = s.restores;
             d["saves"] = s.saves;
             d["loads"] = s.loads;
             d["runs"] = s.runs;
             d["binds"] = s.binds;
             d["bind_seconds"] = static_cast<double>(s.bind_nanoseconds) * 1e-9;
             d["reclaim_seconds"] = static_cast<double>(s.reclaim_nanoseconds) * 1e-9;
             py::typing::List<InfoDict> sessions;
             for (const SessionStats& one : s.sessions) {
               InfoDict entry;
               entry["id"] = one.id;
               entry["resident"] = one.resident;
               entry["bytes"] = one.bytes;
               entry["last_use"] = static_cast<double>(one.last_use_ns) * 1e-9;
               sessions.append(entry);
             }
             d["sessions"] = sessions;
             return d;
           })
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
      .def("close", &Engine::Close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &Engine::closed);
}
