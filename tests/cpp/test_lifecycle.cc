// Session lifecycle in the core: checksums, offload / restore, LRU eviction
// under memory_budget and host_budget, session files.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <thread>

#include "core/checksum.h"
#include "core/state_file.h"
#include "core/errors.h"
#include "test_helpers.h"

namespace aoti_sessions {
namespace {

using testing::KindOf;
using testing::ModelPath;
using testing::OneMethod;
using testing::ReadBuffer;
using testing::RunCounter;

std::shared_ptr<Engine> CounterEngine(std::optional<int64_t> memory_budget = std::nullopt,
                                      std::optional<int64_t> host_budget = std::nullopt,
                                      std::optional<double> idle_timeout = std::nullopt) {
  EngineOptions options;
  options.mutable_patterns = std::vector<std::string>{"acc", "hits"};
  options.memory_budget = memory_budget;
  options.host_budget = host_budget;
  options.idle_timeout_seconds = idle_timeout;
  return Engine::Create(OneMethod(ModelPath("AOTI_SESSIONS_COUNTER_SO")), options);
}

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "/ais-" + std::to_string(::getpid()) + "-" + name;
}

TEST(Checksum, MatchesTheXxh64Reference) {
  // Reference values of XXH64 (seed 0 and 42), from the xxhash library.
  EXPECT_EQ(Checksum64("", 0), 0xef46db3751d8e999ULL);
  EXPECT_EQ(Checksum64("abc", 3), 0x44bc2cf5ad770999ULL);
  EXPECT_EQ(Checksum64("abc", 3, 42), 0x13c1d910702770e6ULL);
  std::string stripes = "0123456789abcdef0123456789abcdef0";  // 32-byte stripe + tail
  EXPECT_EQ(Checksum64(stripes.data(), stripes.size()), 0xe87684f08d6d0816ULL);
  std::vector<unsigned char> bytes(1280);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(i % 256);
  EXPECT_EQ(Checksum64(bytes.data(), bytes.size()), 0xafc184ad7938a354ULL);
  EXPECT_EQ(Checksum64(bytes.data(), bytes.size(), 42), 0x244d19fb92671adbULL);
}

TEST(Tiers, OffloadAndRestoreKeepTheStateBitForBit) {
  auto engine = CounterEngine();
  auto a = engine->NewSession();
  auto reference = engine->NewSession();
  for (int step = 0; step < 3; ++step) {
    RunCounter(*a, 0.25f * step, step);
    RunCounter(*reference, 0.25f * step, step);
  }
  a->Offload();
  EXPECT_FALSE(a->resident());
  EXPECT_EQ(a->address(), nullptr);
  EXPECT_EQ(engine->stats().host_bytes, static_cast<int64_t>(engine->bytes_per_session()));
  // Reads come from the host tier without bringing the session back.
  EXPECT_EQ(ReadBuffer<float>(*engine, *a, "acc"), ReadBuffer<float>(*engine, *reference, "acc"));
  EXPECT_FALSE(a->resident());
  // A run restores it and continues exactly like the session never moved.
  EXPECT_EQ(RunCounter(*a, 1.5f, 3), RunCounter(*reference, 1.5f, 3));
  EXPECT_TRUE(a->resident());
  EngineStats stats = engine->stats();
  EXPECT_EQ(stats.offloads, 1);
  EXPECT_EQ(stats.restores, 1);
  EXPECT_EQ(stats.evictions, 0);
  EXPECT_EQ(stats.host_bytes, 0);
}

TEST(Tiers, EvictsTheLeastRecentlyUsedIdleSession) {
  auto engine = CounterEngine(/*memory_budget=*/1024);  // two 512-byte sessions
  auto a = engine->NewSession();
  auto b = engine->NewSession();
  RunCounter(*a, 1.0f, 0);  // b is now the least recently used
  auto c = engine->NewSession();
  EXPECT_TRUE(a->resident());
  EXPECT_FALSE(b->resident());
  EXPECT_TRUE(c->resident());
  EXPECT_EQ(engine->stats().evictions, 1);
  // Running b brings it back and evicts a (used before c was created).
  RunCounter(*b, 1.0f, 1);
  EXPECT_FALSE(a->resident());
  EXPECT_TRUE(b->resident());
  EngineStats stats = engine->stats();
  EXPECT_EQ(stats.device_bytes, 1024);
  EXPECT_EQ(stats.resident_sessions, 2);
  EXPECT_EQ(stats.offloaded_sessions, 1);
  // The session a call holds is never evicted for that call.
  auto d = CounterEngine(/*memory_budget=*/512);
  auto only = d->NewSession();
  EXPECT_EQ(KindOf([&] { only->Fork(); }), ErrorKind::kCapacity);
  EXPECT_TRUE(only->resident());
}

TEST(Tiers, HostBudgetBoundsOffloading) {
  auto engine = CounterEngine(/*memory_budget=*/512, /*host_budget=*/512);
  auto a = engine->NewSession();
  auto b = engine->NewSession();  // evicts a into the host budget's one slot
  EXPECT_FALSE(a->resident());
  EXPECT_EQ(KindOf([&] { engine->NewSession(); }), ErrorKind::kCapacity);  // both full
  EXPECT_EQ(KindOf([&] { b->Offload(); }), ErrorKind::kCapacity);
  EXPECT_TRUE(b->resident());
  a->Close();  // frees the host slot
  EXPECT_EQ(engine->stats().host_bytes, 0);
  EXPECT_NO_THROW(engine->NewSession());
}

TEST(Files, SaveAndLoadRoundTripAndRefuseCorruption) {
  auto engine = CounterEngine();
  auto a = engine->NewSession();
  RunCounter(*a, 2.0f, 1);
  std::string path = TempPath("a.ais");
  a->Save(path);
  auto b = engine->LoadSession(path, /*strict=*/true);
  EXPECT_EQ(ReadBuffer<float>(*engine, *b, "acc"), ReadBuffer<float>(*engine, *a, "acc"));
  EXPECT_EQ(ReadBuffer<int64_t>(*engine, *b, "hits"), ReadBuffer<int64_t>(*engine, *a, "hits"));
  EXPECT_EQ(RunCounter(*b, 1.0f, 2), RunCounter(*a, 1.0f, 2));

  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto write = [&](const std::string& content) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << content;
  };
  int64_t live = engine->stats().live_sessions;
  std::string flipped = bytes;
  // The payload is acc (128 bytes) then hits at 128, padded to 192 bytes.
  flipped[flipped.size() - 192 + 5] ^= 0x10;
  write(flipped);
  EXPECT_EQ(KindOf([&] { engine->LoadSession(path, true); }), ErrorKind::kSessionFile);
  write(bytes.substr(0, bytes.size() - 1));
  EXPECT_EQ(KindOf([&] { engine->LoadSession(path, true); }), ErrorKind::kSessionFile);
  // A header (with a valid checksum) whose payload length would wrap the
  // file size computation around.
  std::string forged = bytes;
  uint64_t header_length = 0;
  std::memcpy(&header_length, forged.data() + 16, sizeof header_length);
  uint64_t huge = ~uint64_t{0} - 100;
  std::memcpy(&forged[24], &huge, sizeof huge);  // the header starts with the payload length
  uint64_t sum = Checksum64(forged.data(), 24 + header_length);
  std::memcpy(&forged[24 + header_length], &sum, sizeof sum);
  write(forged);
  EXPECT_EQ(KindOf([&] { engine->LoadSession(path, true); }), ErrorKind::kSessionFile);
  write("not a session file at all");
  EXPECT_EQ(KindOf([&] { engine->LoadSession(path, true); }), ErrorKind::kSessionFile);
  std::remove(path.c_str());
  EXPECT_EQ(KindOf([&] { engine->LoadSession(path, true); }), ErrorKind::kFileNotFound);
  EXPECT_EQ(engine->stats().live_sessions, live);
}

TEST(Files, HugeHeadersGiveBoundedMessages) {
  // Valid checksums, but 60,000 methods or buffers: the error names a few.
  auto engine = CounterEngine();
  std::string path = TempPath("huge.ais");
  std::vector<char> zeros(engine->bytes_per_session());
  auto write = [&](int methods, int extra_buffers) {
    StateFileHeader header;
    std::vector<const void*> data;
    for (int i = 0; i < methods; ++i) header.methods.push_back({"m" + std::to_string(i), 1, 2});
    for (const MutableBuffer& b : engine->mutable_buffers()) {
      header.buffers.push_back({b.fqn, DtypeName(b.layout.dtype), b.layout.sizes, b.layout.strides, 0,
                                b.bytes, 0});
      data.push_back(zeros.data());
    }
    for (int i = 0; i < extra_buffers; ++i) {
      header.buffers.push_back({"b" + std::to_string(i), "float32", {1}, {1}, 0, 4, 0});
      data.push_back(zeros.data());
    }
    WriteStateFile(path, header, data);
  };
  for (auto [methods, buffers] : {std::pair{60000, 0}, std::pair{1, 60000}}) {
    write(methods, buffers);
    try {
      engine->LoadSession(path, /*strict=*/true);
      FAIL() << "loaded";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kModelMismatch);
      EXPECT_LT(std::strlen(e.what()), 600u) << e.what();
      EXPECT_NE(std::string(e.what()).find(" more"), std::string::npos) << e.what();
    }
  }
  std::remove(path.c_str());
}

TEST(Tiers, ThreadsRaceEvictionsExpiryAndExplicitMoves) {
  // Budget of two sessions, an idle timer firing constantly, four threads
  // running their own sessions and one moving everyone's state at random:
  // every session ends exactly like the same runs done alone.
  auto engine = CounterEngine(/*memory_budget=*/1024, std::nullopt, /*idle_timeout=*/0.002);
  constexpr int kThreads = 4, kSteps = 60;
  std::vector<std::shared_ptr<Session>> sessions;
  for (int t = 0; t < kThreads; ++t) sessions.push_back(engine->NewSession());
  std::atomic<bool> stop{false};
  std::vector<std::vector<float>> last(kThreads);
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&, t] {
      for (int step = 0; step < kSteps; ++step) last[t] = RunCounter(*sessions[t], 0.5f * t, step % 4);
    });
  }
  std::thread meddler([&] {
    unsigned k = 0;
    while (!stop) {
      Session& s = *sessions[k++ % kThreads];
      if (k % 3 == 0) s.Restore(); else s.Offload();
    }
  });
  for (auto& w : workers) w.join();
  stop = true;
  meddler.join();
  auto solo_engine = CounterEngine();
  for (int t = 0; t < kThreads; ++t) {
    auto solo = solo_engine->NewSession();
    std::vector<float> want;
    for (int step = 0; step < kSteps; ++step) want = RunCounter(*solo, 0.5f * t, step % 4);
    EXPECT_EQ(last[t], want) << t;
    EXPECT_EQ(ReadBuffer<int64_t>(*engine, *sessions[t], "hits"),
              ReadBuffer<int64_t>(*engine, *solo, "hits"))
        << t;
  }
  EngineStats stats = engine->stats();
  EXPECT_GT(stats.evictions + stats.idle_offloads, 0);
  EXPECT_EQ(stats.offloads - stats.restores, stats.offloaded_sessions);
  EXPECT_LE(stats.device_bytes, 1024);
  // Engine and sessions released while the idle timer may be mid-check.
  sessions.clear();
  engine.reset();
}

}  // namespace
}  // namespace aoti_sessions
