// pybind11 module `aoti_sessions._core`: a thin layer over the core. It binds
// the core's value types as classes (so the generated stubs say what crosses
// the boundary), moves tensor handles in and out as capsules (made and consumed
// by torch._C._aoti), releases the GIL around every call that may block or run
// the model, and maps every C++ exception to a Python one through the table in
// aoti_sessions/errors.py. The documented API is python/aoti_sessions.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/typing.h>

#include <cstdint>
#include <new>
#include <stdexcept>
#include <type_traits>

#include "../core/engine.h"
#include "../core/errors.h"
#include "../core/session.h"

namespace py = pybind11;
using namespace aoti_sessions;

using CapsuleList = py::typing::List<py::capsule>;

namespace {

StreamHandle ToStream(uintptr_t stream) { return reinterpret_cast<StreamHandle>(stream); }

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

// Takes ownership of every handle in `capsules` (as made by
// torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors), so none leaks if one of
// them is not a capsule.
// The handle in `item`, owned; an empty OwnedTensor if it is not a capsule.
OwnedTensor TakeHandle(py::handle item) {
  if (!PyCapsule_CheckExact(item.ptr())) return OwnedTensor();
  void* ptr = PyCapsule_GetPointer(item.ptr(), PyCapsule_GetName(item.ptr()));
  if (ptr == nullptr) throw py::error_already_set();
  return OwnedTensor(static_cast<AtenTensorHandle>(ptr));
}

std::vector<OwnedTensor> TakeHandles(const py::list& capsules) {
  std::vector<OwnedTensor> owned;
  owned.reserve(capsules.size());
  bool bad = false;
  for (py::handle item : capsules) {
    OwnedTensor tensor = TakeHandle(item);
    if (tensor.get() == nullptr) {
      bad = true;
      continue;
    }
    owned.push_back(std::move(tensor));
  }
  if (bad) throw py::type_error("expected a list of tensor handle capsules");
  return owned;
}

std::vector<AtenTensorHandle> Borrowed(const std::vector<OwnedTensor>& owned) {
  std::vector<AtenTensorHandle> handles;
  for (const auto& t : owned) handles.push_back(t.get());
  return handles;
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

// A ProxyCall running `call(node, ints, tensors)` in Python: `tensors` are new
// handles (capsules) aliasing the call's tensor arguments, for Python to
// steal; it returns (argument index, result capsule) pairs. A Python
// exception fails the run with its message.
ProxyCall PythonProxyCall(py::function call) {
  // Deleted with the GIL held (the engine may be closed without it), or
  // leaked once the interpreter is finalizing (a thread taking the GIL then
  // would hang).
  std::shared_ptr<py::function> fn(new py::function(std::move(call)), [](py::function* f) {
#if PY_VERSION_HEX >= 0x030D0000
    const bool finalizing = Py_IsFinalizing();
#else
    const bool finalizing = _Py_IsFinalizing();
#endif
    if (!Py_IsInitialized() || finalizing) return;
    py::gil_scoped_acquire gil;
    delete f;
  });
  return [fn](int node, const std::vector<int64_t>& ints, const std::vector<AtenTensorHandle>& tensors) {
    std::vector<OwnedTensor> aliases;
    aliases.reserve(tensors.size());
    for (AtenTensorHandle t : tensors) aliases.push_back(OwnedTensor::Alias(t));
    py::gil_scoped_acquire gil;
    std::vector<std::pair<size_t, OwnedTensor>> results;
    try {
      py::object out = (*fn)(node, ints, GiveHandles(std::move(aliases)));
      for (py::handle item : out) {
        auto pair = item.cast<py::tuple>();
        // A non-capsule result is an empty tensor, which ProxyExecutor refuses.
        results.emplace_back(pair[0].cast<size_t>(), TakeHandle(pair[1]));
      }
    } catch (py::error_already_set& e) {
      throw std::runtime_error(e.what());
    } catch (const py::cast_error& e) {
      throw std::runtime_error(std::string("the proxy call's results: ") + e.what());
    }
    return results;
  };
}

// Characters of an error message at most (as aoti_sessions._words.bounded):
// a message quoting a huge input (a name, a pattern) keeps its start and end.
constexpr size_t kMaxMessage = 1024;

std::string Bounded(const char* message) {
  std::string text(message);
  if (text.size() <= kMaxMessage) return text;
  // Cut between UTF-8 sequences, never inside one (continuation bytes are 10xxxxxx).
  auto continues = [&](size_t at) { return (static_cast<unsigned char>(text[at]) & 0xC0) == 0x80; };
  size_t head = kMaxMessage * 2 / 3, tail_at = text.size() - kMaxMessage / 4;
  while (head > 0 && continues(head)) --head;
  while (tail_at < text.size() && continues(tail_at)) ++tail_at;
  return text.substr(0, head) + "...[" + std::to_string(tail_at - head) + " bytes left out]..." +
         text.substr(tail_at);
}

// A session's getter that may wait (for a run in flight), as a property's
// function that releases the GIL meanwhile.
template <typename Result>
py::cpp_function Released(Result (Session::*getter)()) {
  return py::cpp_function(getter, py::call_guard<py::gil_scoped_release>());
}

// Raises the Python exception aoti_sessions.errors maps `kind` to.
void Raise(const std::string& kind, const char* message) {
  py::object cls = py::module_::import("aoti_sessions.errors").attr("core_error")(kind);
  PyErr_SetString(cls.ptr(), Bounded(message).c_str());
}

// Every exception leaving C++: the core's by kind; host memory exhaustion as
// MemoryError; anything else (a broken invariant) as "internal", never as
// pybind11's default mapping of standard exceptions (IndexError, ...).
void TranslateExceptions(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const Error& e) {
    Raise(KindName(e.kind()), e.what());
  } catch (const std::bad_alloc& e) {
    Raise("out_of_memory", e.what());
  } catch (const py::builtin_exception&) {
    throw;  // raised by this layer on purpose (type_error, ...): pybind11 maps it
  } catch (const py::error_already_set&) {
    throw;  // a Python exception passing through
  } catch (const std::exception& e) {
    Raise(KindName(ErrorKind::kInternal), e.what());
  }
}

// Layout fields of a descriptor, read-only.
template <typename T>
void BindLayout(py::class_<T>& cls) {
  cls.def_property_readonly("dtype", [](const T& x) { return DtypeName(x.layout.dtype); })
      .def_property_readonly("sizes", [](const T& x) { return x.layout.sizes; })
      .def_property_readonly("strides", [](const T& x) { return x.layout.strides; })
      .def_readonly("bytes", &T::bytes)
      .def_readonly("fqn", &T::fqn);
}

void BindValues(py::module_& m) {
  py::class_<InputSpec>(m, "InputSpec")
      .def(py::init<>())
      .def_readwrite("dtype", &InputSpec::dtype)
      .def_readwrite("sizes", &InputSpec::sizes)
      .def_readwrite("strides", &InputSpec::strides);

  py::class_<WeightEntry>(m, "WeightEntry", "One tensor of a weights file.")
      .def(py::init([](std::string fqn, int32_t dtype, std::vector<int64_t> sizes,
                       std::vector<int64_t> strides, uint64_t offset, uint64_t bytes) {
             return WeightEntry{std::move(fqn), TensorLayout{dtype, std::move(sizes), std::move(strides)},
                                offset, bytes};
           }),
           py::arg("fqn"), py::arg("dtype"), py::arg("sizes"), py::arg("strides"),
           py::arg("offset"), py::arg("bytes"))
      .def_readonly("fqn", &WeightEntry::fqn)
      .def_readonly("offset", &WeightEntry::offset)
      .def_readonly("bytes", &WeightEntry::bytes);

  py::class_<WeightsFile>(m, "WeightsFile", "A weights file and the entries one method reads.")
      .def(py::init<>())
      .def_readwrite("path", &WeightsFile::path)
      .def_readwrite("entries", &WeightsFile::entries);

  py::enum_<PoolKind>(m, "PoolKind", "What a unit of a pooled tensor is.")
      .value("PAGES", PoolKind::kPages)
      .value("SLOTS", PoolKind::kSlots);

  py::class_<PooledInput>(m, "PooledInput", "An input of a method that is a pooled tensor.")
      .def(py::init([](size_t input, std::string name, PoolKind kind) {
             return PooledInput{input, std::move(name), kind};
           }),
           py::arg("input"), py::arg("name"), py::arg("kind"))
      .def_readonly("input", &PooledInput::input)
      .def_readonly("name", &PooledInput::name)
      .def_readonly("kind", &PooledInput::kind);

  py::class_<PoolSource>(m, "PoolSource", "How a method addresses the pooled state (input positions).")
      .def(py::init<>())
      .def_readwrite("page_size", &PoolSource::page_size)
      .def_readwrite("tensors", &PoolSource::tensors)
      .def_readwrite("page_table", &PoolSource::page_table)
      .def_readwrite("positions", &PoolSource::positions)
      .def_readwrite("slot_ids", &PoolSource::slot_ids)
      .def_readwrite("tokens", &PoolSource::tokens)
      .def_readwrite("max_pages", &PoolSource::max_pages)
      .def_readwrite("max_rows", &PoolSource::max_rows)
      .def_readwrite("min_rows", &PoolSource::min_rows);

  py::class_<MethodSource>(m, "MethodSource")
      .def(py::init<>())
      .def_readwrite("name", &MethodSource::name)
      .def_readwrite("library_path", &MethodSource::library_path)
      .def_readwrite("cubin_dir", &MethodSource::cubin_dir)
      .def_readwrite("inputs", &MethodSource::inputs)
      .def_readwrite("weights", &MethodSource::weights)
      .def_readwrite("pool", &MethodSource::pool)
      .def(
          "set_proxy",
          [](MethodSource& source,
             py::typing::Callable<py::typing::List<py::typing::Tuple<int, py::capsule>>(
                 int, py::typing::List<int>, CapsuleList)>
                 call) {
            source.proxy = std::make_shared<ProxyExecutor>(PythonProxyCall(std::move(call)));
          },
          py::arg("call"),
          "Runs the ops the library calls through AOTInductor's proxy executor with "
          "call(node, ints, tensors) -> [(argument index, result)] (aoti_sessions._proxy).");

  py::enum_<IdleAction>(m, "IdleAction")
      .value("OFFLOAD", IdleAction::kOffload)
      .value("CLOSE", IdleAction::kClose);

  py::enum_<GraphMode>(m, "GraphMode")
      .value("AUTO", GraphMode::kAuto)
      .value("ON", GraphMode::kOn)
      .value("OFF", GraphMode::kOff);

  py::class_<EngineOptions>(m, "EngineOptions", "Options of an engine (checked by the core).")
      .def(py::init<>())
      .def_readwrite("device", &EngineOptions::device)
      .def_readwrite("mutable_patterns", &EngineOptions::mutable_patterns)
      .def_readwrite("known_mutated", &EngineOptions::known_mutated)
      .def_readwrite("max_sessions", &EngineOptions::max_sessions)
      .def_readwrite("memory_budget", &EngineOptions::memory_budget)
      .def_readwrite("host_budget", &EngineOptions::host_budget)
      .def_readwrite("idle_timeout", &EngineOptions::idle_timeout_seconds)
      .def_readwrite("idle_action", &EngineOptions::idle_action)
      .def_readwrite("reclaim_bind_handles", &EngineOptions::reclaim_bind_handles)
      .def_readwrite("strict_weights", &EngineOptions::strict_weights)
      .def_readwrite("lanes", &EngineOptions::lanes)
      .def_readwrite("cuda_graphs", &EngineOptions::cuda_graphs)
      .def_readwrite("graph_output_views", &EngineOptions::graph_output_views);

  py::class_<MutableBuffer> buffer(m, "BufferInfo", "A mutable buffer (per-session state).");
  BindLayout(buffer);
  buffer.def_readonly("zero_initial", &MutableBuffer::zero_initial)
      .def_readonly("methods", &MutableBuffer::methods);

  py::class_<PooledTensor>(m, "PooledTensor", "A pooled tensor: [units, ...unit sizes].")
      .def_readonly("name", &PooledTensor::name)
      .def_readonly("kind", &PooledTensor::kind)
      .def_property_readonly("dtype", [](const PooledTensor& t) { return DtypeName(t.unit.dtype); })
      .def_property_readonly("unit_sizes", [](const PooledTensor& t) { return t.unit.sizes; })
      .def_readonly("unit_bytes", &PooledTensor::unit_bytes);

  py::class_<PoolLayout>(m, "PoolLayout", "The pooled state every pooled method shares.")
      .def_readonly("page_size", &PoolLayout::page_size)
      .def_readonly("max_pages", &PoolLayout::max_pages)
      .def_readonly("max_rows", &PoolLayout::max_rows)
      .def_readonly("tensors", &PoolLayout::tensors)
      .def_readonly("page_bytes", &PoolLayout::page_bytes)
      .def_readonly("slot_bytes", &PoolLayout::slot_bytes)
      .def_property_readonly("max_positions", &PoolLayout::max_positions);

  py::class_<WeightInfo> weight(m, "WeightInfo", "A weight held by the engine.");
  BindLayout(weight);
  weight.def_readonly("methods", &WeightInfo::methods);

  py::class_<MemoryReport>(m, "MemoryReport", "Bytes by holder.")
      .def_readonly("weights", &MemoryReport::weights)
      .def_readonly("templates", &MemoryReport::templates)
      .def_readonly("sessions", &MemoryReport::sessions)
      .def_readonly("containers", &MemoryReport::containers)
      .def_readonly("offloaded", &MemoryReport::offloaded)
      .def_readonly("pool", &MemoryReport::pool)
      .def_readonly("host_spare", &MemoryReport::host_spare);

  py::class_<SessionStats>(m, "SessionStats", "Where one session is.")
      .def_readonly("id", &SessionStats::id)
      .def_readonly("resident", &SessionStats::resident)
      .def_readonly("bytes", &SessionStats::bytes)
      .def_property_readonly("last_use", [](const SessionStats& s) { return s.last_use_ns * 1e-9; });

  py::class_<EngineStats> stats(m, "EngineStats", "Counters of an engine.");
  for (auto [name, field] : std::initializer_list<std::pair<const char*, int64_t EngineStats::*>>{
           {"live_sessions", &EngineStats::live_sessions},
           {"live_bytes", &EngineStats::live_bytes},
           {"resident_sessions", &EngineStats::resident_sessions},
           {"offloaded_sessions", &EngineStats::offloaded_sessions},
           {"device_bytes", &EngineStats::device_bytes},
           {"host_bytes", &EngineStats::host_bytes},
           {"host_spare_bytes", &EngineStats::host_spare_bytes},
           {"sessions_created", &EngineStats::sessions_created},
           {"offloads", &EngineStats::offloads},
           {"evictions", &EngineStats::evictions},
           {"idle_offloads", &EngineStats::idle_offloads},
           {"idle_closes", &EngineStats::idle_closes},
           {"discards", &EngineStats::discards},
           {"restores", &EngineStats::restores},
           {"saves", &EngineStats::saves},
           {"loads", &EngineStats::loads},
           {"runs", &EngineStats::runs},
           {"binds", &EngineStats::binds},
           {"lanes", &EngineStats::lanes},
           {"graph_replays", &EngineStats::graph_replays},
           {"graph_captures", &EngineStats::graph_captures},
           {"graphs", &EngineStats::graphs},
           {"graph_pools", &EngineStats::graph_pools},
           {"pool_pages", &EngineStats::pool_pages},
           {"pool_pages_used", &EngineStats::pool_pages_used},
           {"pool_slots", &EngineStats::pool_slots},
           {"pool_slots_used", &EngineStats::pool_slots_used},
           {"pool_grows", &EngineStats::pool_grows},
           {"pages_copied", &EngineStats::pages_copied},
           {"batch_runs", &EngineStats::batch_runs},
           {"batch_rows", &EngineStats::batch_rows}}) {
    stats.def_readonly(name, field);
  }
  stats.def_property_readonly("bind_seconds", [](const EngineStats& s) { return s.bind_nanoseconds * 1e-9; })
      .def_property_readonly("reclaim_seconds",
                             [](const EngineStats& s) { return s.reclaim_nanoseconds * 1e-9; })
      .def_property_readonly("batch_seconds",
                             [](const EngineStats& s) { return s.batch_nanoseconds * 1e-9; })
      .def_readonly("sessions", &EngineStats::sessions);
}

void BindSession(py::module_& m) {
  py::class_<SessionSnapshot, std::shared_ptr<SessionSnapshot>>(
      m, "SessionSnapshot", "A host copy of a session's state at one moment, written to a file later.")
      .def(
          "write",
          [](const SessionSnapshot& s, const std::string& path, const py::bytes& attachment) {
            std::string attached = attachment;  // (copied while the GIL is held)
            py::gil_scoped_release release;
            s.Write(path, attached);
          },
          py::arg("path"), py::arg("attachment") = py::bytes(),
          "Writes the copy, and the attachment's bytes with it, to a session file.")
      .def_property_readonly("nbytes", &SessionSnapshot::bytes, "Bytes of state it holds.");

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
      .def_property(
          "discardable", &Session::discardable,
          [](Session& s, bool discardable) {
            py::gil_scoped_release release;  // waits for a run of this session in flight
            s.SetDiscardable(discardable);
          },
          "Whether the engine may close the session when it needs room (before offloading any "
          "session, instead of refusing one at max_sessions) and at idle_timeout.")
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
          [](Session& s, const std::string& path, const py::bytes& attachment, uintptr_t stream) {
            std::string attached = attachment;  // (copied while the GIL is held)
            py::gil_scoped_release release;
            s.Save(path, attached, ToStream(stream));
          },
          py::arg("path"), py::arg("attachment") = py::bytes(), py::arg("stream") = 0,
          "Writes the state, and the attachment's bytes with it, to a session file.")
      .def(
          "snapshot", [](Session& s, uintptr_t stream) { return s.Snapshot(ToStream(stream)); },
          py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
          "A host copy of the state now (the session locked only while it is copied out).")
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
          "read_buffers",
          [](Session& s, const CapsuleList& dsts, uintptr_t stream) {
            std::vector<OwnedTensor> owned = TakeHandles(dsts);
            py::gil_scoped_release release;
            s.ReadBuffers(Borrowed(owned), ToStream(stream));
          },
          py::arg("dsts"), py::arg("stream") = 0,
          "Copies every buffer at once into `dsts` (one snapshot).")
      .def(
          "write_buffers",
          [](Session& s, const std::vector<std::string>& fqns, const CapsuleList& sources,
             uintptr_t stream) {
            std::vector<OwnedTensor> owned = TakeHandles(sources);
            py::gil_scoped_release release;
            s.WriteBuffers(fqns, Borrowed(owned), ToStream(stream));
          },
          py::arg("fqns"), py::arg("sources"), py::arg("stream") = 0,
          "Replaces every buffer at once: sources[i] is the new value of fqns[i].")
      // (Each waits for a run of this session in flight: the GIL is released.)
      .def_property_readonly("length", Released(&Session::length),
                             "Positions the session holds (pooled state; 0 without).")
      .def(
          "truncate",
          [](Session& s, int64_t length, uintptr_t stream) { s.Truncate(length, ToStream(stream)); },
          py::arg("length"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "checkpoint",
          [](Session& s, int64_t keep, uintptr_t stream) { s.Checkpoint(keep, ToStream(stream)); },
          py::arg("keep"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
          "Keeps a copy of the slot state at the session's length (Truncate rewinds there).")
      .def_property_readonly("checkpoints", Released(&Session::Checkpoints),
                             "The lengths the session has checkpoints at, ascending.")
      .def(
          "read_pool",
          [](Session& s, uintptr_t stream) {
            int64_t length = 0;
            std::vector<OwnedTensor> out;
            {
              py::gil_scoped_release release;
              out = s.ReadPool(&length, ToStream(stream));
            }
            return py::make_tuple(GiveHandles(std::move(out)), length);
          },
          py::arg("stream") = 0,
          "(handles, length): the session's part of every pooled tensor, one snapshot.")
      .def(
          "write_pool",
          [](Session& s, const std::vector<std::string>& names, const CapsuleList& sources,
             int64_t length, uintptr_t stream) {
            std::vector<OwnedTensor> owned = TakeHandles(sources);
            py::gil_scoped_release release;
            s.WritePool(names, Borrowed(owned), length, ToStream(stream));
          },
          py::arg("names"), py::arg("sources"), py::arg("length"), py::arg("stream") = 0,
          "Replaces the session's pooled state (as read_pool gives it) and its length.")
      .def("close", &Session::Close, py::call_guard<py::gil_scoped_release>());
}

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

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "C++ core of aoti_sessions (private; use the aoti_sessions package)";
  py::register_exception_translator(&TranslateExceptions);

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
  m.def(
      "error_kinds",
      [] {
        std::vector<std::string> names;
        for (ErrorKind kind : kAllErrorKinds) names.push_back(KindName(kind));
        return names;
      },
      "Names of every error kind the core raises (keys of aoti_sessions.errors.CORE_ERRORS).");
  m.def(
      "_throw_for_test",
      [](const std::string& kind, const std::string& message) {
        for (ErrorKind k : kAllErrorKinds) {
          if (kind == KindName(k)) Throw(k, message);
        }
        if (kind == "bad_alloc") throw std::bad_alloc();
        throw std::out_of_range(message);  // any other standard exception
      },
      py::arg("kind"), py::arg("message"),
      "Throws a C++ exception of `kind` (tests of the exception table).");
  BindValues(m);
  BindSession(m);
  BindEngine(m);
}
