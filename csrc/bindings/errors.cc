// C++ exceptions as Python ones: the core's by kind through the table in
// aoti_sessions/errors.py, messages bounded.
#include <new>
#include <stdexcept>
#include <string>

#include "common.h"

namespace aoti_sessions::bindings {

namespace {

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

// Raises the Python exception aoti_sessions.errors maps `kind` to.
void Raise(const std::string& kind, const char* message) {
  py::object cls = py::module_::import("aoti_sessions.errors").attr("core_error")(kind);
  PyErr_SetString(cls.ptr(), Bounded(message).c_str());
}

}  // namespace

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

}  // namespace aoti_sessions::bindings
