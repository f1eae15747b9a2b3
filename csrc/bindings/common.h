// What the binding files share (csrc/bindings): tensor handles in and out as
// capsules, streams as integers, the exception translator, and each file's
// Bind function, called once by module.cc.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/typing.h>

#include <cstdint>
#include <exception>
#include <vector>

#include "../core/engine.h"
#include "../core/errors.h"
#include "../core/session.h"

namespace aoti_sessions::bindings {

namespace py = pybind11;
using CapsuleList = py::typing::List<py::capsule>;

inline StreamHandle ToStream(uintptr_t stream) { return reinterpret_cast<StreamHandle>(stream); }

// -- handles.cc: tensor handles crossing the boundary as capsules -----------
// The handle in `item`, owned; an empty OwnedTensor if it is not a capsule.
OwnedTensor TakeHandle(py::handle item);
// Takes ownership of every handle in `capsules` (as made by
// torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors), so none leaks if one of
// them is not a capsule.
std::vector<OwnedTensor> TakeHandles(const py::list& capsules);
std::vector<AtenTensorHandle> Borrowed(const std::vector<OwnedTensor>& owned);
// Hands the handles over as capsules, for Python to steal.
CapsuleList GiveHandles(std::vector<OwnedTensor>&& tensors);

// -- errors.cc --------------------------------------------------------------
// Every exception leaving C++, mapped through aoti_sessions/errors.py.
void TranslateExceptions(std::exception_ptr p);

// A session's getter that may wait (for a run in flight), as a property's
// function that releases the GIL meanwhile.
template <typename Result>
py::cpp_function Released(Result (Session::*getter)()) {
  return py::cpp_function(getter, py::call_guard<py::gil_scoped_release>());
}

// -- the classes, by file ---------------------------------------------------
void BindValues(py::module_& m);   // values.cc: the core's value types
void BindSession(py::module_& m);  // session.cc: Session, SessionSnapshot
void BindEngine(py::module_& m);   // engine.cc: Engine

}  // namespace aoti_sessions::bindings
