// Session and SessionSnapshot: the GIL released around every call that may block.
#include "common.h"

namespace aoti_sessions::bindings {

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

}  // namespace aoti_sessions::bindings
