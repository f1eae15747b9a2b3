// Tensor handles in and out of Python as capsules (common.h).
#include "common.h"

namespace aoti_sessions::bindings {

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

}  // namespace aoti_sessions::bindings
