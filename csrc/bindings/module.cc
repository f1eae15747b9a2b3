// pybind11 module `aoti_sessions._core`: a thin layer over the core. It binds
// the core's value types as classes (so the generated stubs say what crosses
// the boundary), moves tensor handles in and out as capsules (made and consumed
// by torch._C._aoti), releases the GIL around every call that may block or run
// the model, and maps every C++ exception to a Python one through the table in
// aoti_sessions/errors.py. The documented API is python/aoti_sessions; a file
// here binds each class (common.h lists them).
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"

using namespace aoti_sessions;
using namespace aoti_sessions::bindings;

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
