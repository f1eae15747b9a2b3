// What every state store shares: the source a host copy gives.
#include "state_store.h"

namespace aoti_sessions {

StateStore::Source StateStore::From(const HostCopy& copy) {
  Source source;
  source.initial = false;
  source.memory = static_cast<const char*>(copy.data());
  source.on_host = true;
  source.length = copy.length;
  source.pages = copy.pages;
  return source;
}

}  // namespace aoti_sessions
