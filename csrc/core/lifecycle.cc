// Session lifecycle: the two tiers of session state (device and host), the
// eviction policy under memory_budget / host_budget, idle expiry, and session
// files (save / load).
#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <set>
#include <thread>

#include "checksum.h"
#include "engine.h"
#include "errors.h"
#include "session.h"

namespace aoti_sessions {
namespace {

// Spare host blocks kept for the next offload, restore-evict pair or save.
constexpr size_t kSpareHostBlocks = 2;
// How long a creator waits for a busy session to become evictable.
constexpr auto kCapacityWait = std::chrono::seconds(60);

std::string Bytes(int64_t n) { return std::to_string(n) + " bytes"; }

std::string Names(const std::set<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "none" : out;
}

}  // namespace

// ---------------------------------------------------------------- host blocks

void* Engine::TakeHostBlock() {
  if (block_bytes_ == 0) return nullptr;
  {
    std::lock_guard<std::mutex> lock(host_mutex_);
    if (!spare_host_.empty()) {
      void* block = spare_host_.back();
      spare_host_.pop_back();
      return block;
    }
  }
  return device_->AllocateHost(block_bytes_);
}

size_t Engine::HostSpareBytes() const {
  std::lock_guard<std::mutex> lock(host_mutex_);
  return spare_host_.size() * block_bytes_;
}

void Engine::GiveHostBlock(void* block) noexcept {
  if (block == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(host_mutex_);
    if (spare_host_.size() < kSpareHostBlocks) {
      spare_host_.push_back(block);
      return;
    }
  }
  device_->FreeHost(block);
}

// ---------------------------------------------------------------- tiers

void Engine::OffloadLocked(Session& session, StreamHandle stream, OffloadCause cause,
                           int64_t host_credit) {
  if (!session.resident_) return;
  const auto need = static_cast<int64_t>(block_bytes_);
  {
    std::lock_guard<std::mutex> lock(sessions_mutex_);
    if (options_.host_budget >= 0 && host_bytes_ + need - host_credit > options_.host_budget) {
      Throw(ErrorKind::kCapacity,
            "host_budget=" + Bytes(options_.host_budget) + " is full: " +
                std::to_string(offloaded_sessions_) + " offloaded sessions hold " +
                Bytes(host_bytes_) + " and session " + std::to_string(session.id_) + " needs " +
                std::to_string(need));
    }
    host_bytes_ += need;
  }
  void* host = nullptr;
  try {
    HostBlock block(*this);
    session.Use(stream);
    if (need > 0) {
      device_->Copy(block.get(), session.block_, block_bytes_, stream);
      device_->Synchronize(stream);
    }
    host = block.release();
  } catch (...) {
    std::lock_guard<std::mutex> lock(sessions_mutex_);
    host_bytes_ -= need;
    throw;
  }
  // The containers may still point at the device block: the session gets a
  // new bind key when it comes back, so every method rebinds before a run.
  session.tensors_.clear();
  void* device_block = std::exchange(session.block_, nullptr);
  session.host_block_ = host;
  session.resident_ = false;
  try {
    if (device_block != nullptr) device_->Free(device_block, stream);
  } catch (...) {
    // The state is safe on the host; a failed free only leaks device memory.
  }
  {
    std::lock_guard<std::mutex> lock(sessions_mutex_);
    device_bytes_ -= need;
    ++offloaded_sessions_;
    RetainLocked();
  }
  offloads_.fetch_add(1);
  if (cause == OffloadCause::kEviction) evictions_.fetch_add(1);
  if (cause == OffloadCause::kIdle) idle_offloads_.fetch_add(1);
}

void Engine::RestoreLocked(Session& session, StreamHandle stream) {
  if (session.resident_) return;
  ReserveDevice(&session, stream);
  void* block = nullptr;
  std::vector<OwnedTensor> tensors;
  try {
    if (block_bytes_ > 0) {
      block = device_->Allocate(block_bytes_, stream);
      session.Use(stream);
      device_->Copy(block, session.host_block_, block_bytes_, stream);
      // The host block goes back to the pool right after.
      device_->Synchronize(stream);
    }
    tensors = session.AliasTensors(block);
  } catch (...) {
    // The session stays offloaded, its host block untouched.
    if (block != nullptr) {
      try {
        device_->Free(block, stream);
      } catch (...) {
      }
    }
    UnreserveDevice();
    throw;
  }
  GiveHostBlock(std::exchange(session.host_block_, nullptr));
  session.block_ = block;
  session.tensors_ = std::move(tensors);
  session.bind_key_ = next_bind_key_++;
  session.resident_ = true;
  {
    std::lock_guard<std::mutex> lock(sessions_mutex_);
    host_bytes_ -= static_cast<int64_t>(block_bytes_);
    --offloaded_sessions_;
  }
  restores_.fetch_add(1);
}

void Engine::UnreserveDevice() {
  std::lock_guard<std::mutex> lock(sessions_mutex_);
  device_bytes_ -= static_cast<int64_t>(block_bytes_);
  RetainLocked();
}

void Engine::ReserveDevice(const Session* held, StreamHandle stream) {
  const auto need = static_cast<int64_t>(block_bytes_);
  const int64_t budget = options_.memory_budget;
  const auto deadline = std::chrono::steady_clock::now() + kCapacityWait;
  // A restore releases its own host block right after evicting: the swap
  // leaves host use unchanged, so a full host budget does not stop it.
  const int64_t host_credit = held != nullptr && !held->resident_ ? need : 0;
  struct Waiting {  // marks `held` (if resident) as busy until room is made
    const Session* session;
    explicit Waiting(const Session* s) : session(s && s->resident_ ? s : nullptr) {
      if (session) session->waiting_for_room_ = true;
    }
    ~Waiting() {
      if (session) session->waiting_for_room_ = false;
    }
  } waiting(held);
  std::unique_lock<std::mutex> lock(sessions_mutex_);
  for (;;) {
    if (closed_) Throw(ErrorKind::kSessionClosed, "the engine is closed");
    if (budget < 0 || device_bytes_ + need <= budget) {
      device_bytes_ += need;
      RetainLocked();
      return;
    }
    std::string full = "memory_budget=" + Bytes(budget) + " exceeded: " +
                       std::to_string(device_bytes_ / need) + " sessions hold " +
                       std::to_string(device_bytes_) + " bytes and a new one needs " +
                       std::to_string(need);
    if (need > budget) Throw(ErrorKind::kCapacity, full + " (the budget is below one session)");
    if (options_.host_budget >= 0 && host_bytes_ + need - host_credit > options_.host_budget) {
      Throw(ErrorKind::kCapacity, full + ", and host_budget=" + Bytes(options_.host_budget) +
                                      " cannot take an offloaded session (" +
                                      Bytes(host_bytes_) + " offloaded)");
    }
    // Idle resident sessions, least recently used first.
    std::vector<std::shared_ptr<Session>> candidates = OpenSessionsLocked();
    // Device bytes reserved by creations and restores in flight (or held by
    // sessions being destroyed): they become idle or free soon.
    int64_t resident = 0;
    for (const auto& s : candidates) resident += s->resident_ ? 1 : 0;
    const bool in_flight = device_bytes_ > resident * need;
    lock.unlock();
    // Sessions held by calls that are themselves waiting for room never
    // become idle before this call proceeds: waiting for them is futile.
    candidates.erase(std::remove_if(candidates.begin(), candidates.end(),
                                    [&](const auto& s) {
                                      return s.get() == held || !s->resident_ || s->closed_ ||
                                             s->waiting_for_room_;
                                    }),
                     candidates.end());
    std::sort(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) {
      return a->last_use_ns() < b->last_use_ns();
    });
    bool evicted = false;
    const bool any = !candidates.empty();
    try {
      for (const auto& candidate : candidates) {
        if (TryEvict(*candidate, stream, host_credit)) {
          evicted = true;
          break;
        }
      }
    } catch (...) {
      candidates.clear();  // may close sessions: never under the lock
      throw;
    }
    candidates.clear();
    lock.lock();
    if (evicted) continue;
    const int64_t ours = held != nullptr && held->resident_ ? need : 0;
    if (!any && device_bytes_ <= ours) {
      Throw(ErrorKind::kCapacity, full + "; the only resident session is the one this call uses");
    }
    if (!any && !in_flight) {
      Throw(ErrorKind::kCapacity,
            full + "; every resident session is held by a call waiting for room itself");
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      Throw(ErrorKind::kCapacity, full + "; every resident session stayed in use for " +
                                      std::to_string(kCapacityWait.count()) + " s");
    }
    // Every resident session is in use: wait for one to finish its operation.
    capacity_waiters_.fetch_add(1);
    capacity_cv_.wait_for(lock, std::chrono::milliseconds(5));
    capacity_waiters_.fetch_sub(1);
  }
}

bool Engine::TryEvict(Session& victim, StreamHandle stream, int64_t host_credit) {
  std::unique_lock<std::mutex> lock(victim.mutex_, std::try_to_lock);
  if (!lock.owns_lock()) return false;  // in use: never evicted
  if (!victim.closed_ && victim.resident_) {
    OffloadLocked(victim, stream, OffloadCause::kEviction, host_credit);
  }
  return true;  // room was made, or the session left the device meanwhile
}

std::vector<std::shared_ptr<Session>> Engine::OpenSessionsLocked() const {
  // Whoever holds the result must release it without sessions_mutex_: the
  // last reference to a session closes it, which takes that lock.
  std::vector<std::shared_ptr<Session>> open;
  open.reserve(sessions_.size());
  for (const auto& [id, weak] : sessions_) {
    if (auto session = weak.lock()) open.push_back(std::move(session));
  }
  return open;
}

void Engine::NotifyIdle() {
  if (capacity_waiters_.load(std::memory_order_relaxed) > 0) {
    // Taking the lock orders the notification after a waiter's check.
    { std::lock_guard<std::mutex> lock(sessions_mutex_); }
    capacity_cv_.notify_all();
  }
}

// ---------------------------------------------------------------- idle expiry

struct Engine::Reaper {
  std::mutex mutex;
  std::condition_variable cv;
  bool stop = false;
  std::mutex join_mutex;  // one stopper joins (Close and ~Engine may race)
  std::thread thread;
};

void Engine::StartReaper() {
  if (options_.idle_timeout_seconds <= 0) return;
  reaper_ = std::make_shared<Reaper>();
  // Check often enough to expire within an eighth of the timeout.
  auto period = std::chrono::duration<double>(options_.idle_timeout_seconds / 8);
  period = std::clamp(period, std::chrono::duration<double>(0.005), std::chrono::duration<double>(1.0));
  // The thread holds the engine only while it checks: the engine's last
  // owner may be a session it checks, and the engine then ends on this
  // thread (StopReaper detaches it; the shared state outlives the engine).
  reaper_->thread = std::thread([weak = weak_from_this(), state = reaper_, period] {
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(state->mutex);
        state->cv.wait_for(lock, period, [&] { return state->stop; });
        if (state->stop) return;
      }
      std::shared_ptr<Engine> engine = weak.lock();
      if (!engine) return;
      try {
        engine->ExpireIdle();
      } catch (...) {
        // Expiry is best effort; the next round tries again.
      }
    }
  });
}

void Engine::StopReaper() noexcept {
  if (!reaper_) return;
  {
    std::lock_guard<std::mutex> lock(reaper_->mutex);
    reaper_->stop = true;
  }
  reaper_->cv.notify_all();
  std::lock_guard<std::mutex> lock(reaper_->join_mutex);
  if (!reaper_->thread.joinable()) return;
  if (reaper_->thread.get_id() == std::this_thread::get_id()) {
    reaper_->thread.detach();
  } else {
    reaper_->thread.join();
  }
}

void Engine::ExpireIdle() {
  // Saturated: a timeout of centuries must not overflow.
  const auto timeout_ns = static_cast<int64_t>(std::min(options_.idle_timeout_seconds, 1e9) * 1e9);
  const int64_t limit = SteadyNowNs() - timeout_ns;
  std::vector<std::shared_ptr<Session>> open;
  {
    std::lock_guard<std::mutex> lock(sessions_mutex_);
    if (closed_) return;
    open = OpenSessionsLocked();
  }
  bool freed = false;
  for (const auto& session : open) {
    if (session->last_use_ns() > limit || !(options_.idle_close || session->resident_)) continue;
    std::unique_lock<std::mutex> lock(session->mutex_, std::try_to_lock);
    if (!lock.owns_lock() || session->closed_ || session->last_use_ns() > limit) continue;
    try {
      if (options_.idle_close) {
        session->CloseLocked("closed by idle_timeout=" +
                             std::to_string(options_.idle_timeout_seconds) + " s");
        idle_closes_.fetch_add(1);
      } else {
        OffloadLocked(*session, session->stream_.last(), OffloadCause::kIdle);
      }
      freed = true;
    } catch (...) {
      // Host budget full (or a device error): the session stays where it is.
    }
  }
  if (freed) NotifyIdle();
}

// ---------------------------------------------------------------- session files

const std::vector<StateFileMethod>& Engine::fingerprint() {
  std::lock_guard<std::mutex> lock(fingerprint_mutex_);
  if (!fingerprint_) {
    std::unordered_map<std::string, uint64_t> hashed;  // a file shared by methods is read once
    auto hash = [&](const std::string& path) {
      auto it = hashed.find(path);
      if (it != hashed.end()) return it->second;
      // The files must still be what the engine loaded, before and after.
      auto unchanged = [&] {
        try {
          return StampFile(path) == file_stamps_.at(path);
        } catch (const Error&) {
          return false;
        }
      };
      std::string changed = "cannot fingerprint the engine for session files: " + path +
                            " was changed or removed since the engine loaded it";
      if (!unchanged()) Throw(ErrorKind::kPackage, changed);
      uint64_t h = HashFile(path);
      if (!unchanged()) Throw(ErrorKind::kPackage, changed);
      return hashed[path] = h;
    };
    std::vector<StateFileMethod> methods;
    for (const Method& m : methods_) {
      methods.push_back({m.name, hash(m.library_path), m.weights_file ? hash(m.weights_file->path) : 0});
    }
    fingerprint_ = std::move(methods);
  }
  return *fingerprint_;
}

void Engine::WriteSessionFile(const std::string& path, const void* state) {
  StateFileHeader header;
  header.methods = fingerprint();
  std::vector<const void*> data;
  for (const MutableBuffer& b : buffers_) {
    StateFileBuffer entry;
    entry.fqn = b.fqn;
    entry.dtype = DtypeName(b.layout.dtype);
    entry.sizes = b.layout.sizes;
    entry.strides = b.layout.strides;
    entry.bytes = b.bytes;
    header.buffers.push_back(std::move(entry));
    data.push_back(static_cast<const char*>(state) + b.offset);
  }
  WriteStateFile(path, std::move(header), data);
  saves_.fetch_add(1);
}

std::shared_ptr<Session> Engine::LoadSession(const std::string& path, bool strict,
                                             StreamHandle stream) {
  if (closed()) Throw(ErrorKind::kSessionClosed, "the engine is closed");
  StateFileReader reader(path);
  const StateFileHeader& header = reader.header();
  const std::string from = "session file " + path + " was saved from another model: ";
  // The file buffer that feeds each engine buffer.
  std::vector<size_t> source(buffers_.size(), SIZE_MAX);
  std::set<std::string> unknown, missing;
  for (size_t i = 0; i < header.buffers.size(); ++i) {
    auto it = buffer_index_.find(header.buffers[i].fqn);
    if (it == buffer_index_.end() || source[it->second] != SIZE_MAX) {
      unknown.insert(header.buffers[i].fqn);
    } else {
      source[it->second] = i;
    }
  }
  for (size_t i = 0; i < buffers_.size(); ++i) {
    if (source[i] == SIZE_MAX) missing.insert(buffers_[i].fqn);
  }
  if (!unknown.empty() || !missing.empty()) {
    Throw(ErrorKind::kModelMismatch, from + "it has buffers this engine lacks (" + Names(unknown) +
                                         ") and lacks buffers this engine has (" +
                                         Names(missing) + ")");
  }
  for (size_t i = 0; i < buffers_.size(); ++i) {
    const MutableBuffer& want = buffers_[i];
    const StateFileBuffer& got = header.buffers[source[i]];
    TensorLayout layout;
    layout.dtype = DtypeFromName(got.dtype);
    layout.sizes = got.sizes;
    layout.strides = got.strides;
    // The byte count too: it sizes the read into the engine's buffer.
    if (layout != want.layout || got.bytes != want.bytes) {
      Throw(ErrorKind::kModelMismatch, from + "buffer '" + want.fqn + "' is " + layout.ToString() +
                                           " in the file but " + want.layout.ToString() +
                                           " in this engine");
    }
  }
  if (strict) {
    const auto& mine = fingerprint();
    std::set<std::string> theirs_names, my_names;
    for (const auto& m : header.methods) theirs_names.insert(m.name);
    for (const auto& m : mine) my_names.insert(m.name);
    const std::string relax = " (load_session(..., strict=False) accepts state whose buffers match)";
    if (theirs_names != my_names) {
      Throw(ErrorKind::kModelMismatch, from + "its methods are (" + Names(theirs_names) +
                                           "), this engine's are (" + Names(my_names) + ")" + relax);
    }
    for (const auto& theirs : header.methods) {
      const auto& m = *std::find_if(mine.begin(), mine.end(),
                                    [&](const StateFileMethod& x) { return x.name == theirs.name; });
      if (theirs.library_hash != m.library_hash) {
        Throw(ErrorKind::kModelMismatch,
              from + "method '" + m.name + "' has another compiled library" + relax);
      }
      if (theirs.weights_hash != m.weights_hash) {
        Throw(ErrorKind::kModelMismatch, from + "method '" + m.name + "' has other weights" + relax);
      }
    }
  }
  // Every byte is read and checked before a session is made.
  HostBlock staging(*this);
  auto* base = static_cast<char*>(staging.get());
  // Each buffer is read into place; only the alignment padding between them
  // is zeroed (a session block's padding is zero, as a fresh one's is).
  std::vector<const MutableBuffer*> by_offset;
  for (const MutableBuffer& b : buffers_) by_offset.push_back(&b);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const MutableBuffer* a, const MutableBuffer* b) { return a->offset < b->offset; });
  size_t end = 0;
  for (const MutableBuffer* b : by_offset) {
    std::memset(base + end, 0, b->offset - end);
    end = b->offset + b->bytes;
  }
  if (block_bytes_ > end) std::memset(base + end, 0, block_bytes_ - end);
  for (size_t i = 0; i < buffers_.size(); ++i) {
    reader.ReadBuffer(source[i], base + buffers_[i].offset);
  }
  auto session = CreateSession(stream, staging.get(), /*from_host=*/true);
  loads_.fetch_add(1);
  return session;
}

}  // namespace aoti_sessions
