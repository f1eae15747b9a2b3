// The core's value types as Python classes (options, descriptors, stats), so
// the generated stubs say what crosses the boundary.
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "common.h"

namespace aoti_sessions::bindings {

namespace {

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

// Layout fields of a descriptor, read-only.
template <typename T>
void BindLayout(py::class_<T>& cls) {
  cls.def_property_readonly("dtype", [](const T& x) { return DtypeName(x.layout.dtype); })
      .def_property_readonly("sizes", [](const T& x) { return x.layout.sizes; })
      .def_property_readonly("strides", [](const T& x) { return x.layout.strides; })
      .def_readonly("bytes", &T::bytes)
      .def_readonly("fqn", &T::fqn);
}

}  // namespace

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

}  // namespace aoti_sessions::bindings
