// Engine and sessions over the Counter test model: templates, binds,
// isolation, and every fail-closed path.
#include <gtest/gtest.h>

#include "core/errors.h"
#include "test_helpers.h"

namespace aoti_sessions {
namespace {

using testing::HostTensor;
using testing::KindOf;
using testing::ModelPath;
using testing::OneMethod;
using testing::ReadBuffer;
using testing::RunCounter;

EngineOptions Mutable(std::vector<std::string> fqns) {
  EngineOptions options;
  options.mutable_patterns = std::move(fqns);
  return options;
}

std::shared_ptr<Engine> CounterEngine(EngineOptions options = Mutable({"acc", "hits"})) {
  return Engine::Create(OneMethod(ModelPath("AOTI_SESSIONS_COUNTER_SO")), options);
}

TEST(Engine, DescribesMutableBuffers) {
  auto engine = CounterEngine();
  const auto& buffers = engine->mutable_buffers();
  ASSERT_EQ(buffers.size(), 2u);
  const MutableBuffer& acc = buffers[engine->buffer_index("acc")];
  const MutableBuffer& hits = buffers[engine->buffer_index("hits")];
  EXPECT_EQ(acc.layout.sizes, (std::vector<int64_t>{4, 8}));
  EXPECT_FALSE(acc.zero_initial);
  EXPECT_TRUE(hits.zero_initial);
  EXPECT_EQ(acc.offset, 0u);  // non-zero templates first
  EXPECT_EQ(hits.offset, 256u);
  EXPECT_EQ(engine->bytes_per_session(), 512u);
  EXPECT_EQ(engine->template_bytes(), 256u);  // the zero buffer costs none
  EXPECT_EQ(acc.methods, (std::vector<std::string>{"model"}));
}

TEST(Engine, DefaultsToEveryBufferTypedConstant) {
  EngineOptions options;  // no declaration
  auto engine = CounterEngine(options);
  std::vector<std::string> fqns;
  for (const auto& b : engine->mutable_buffers()) fqns.push_back(b.fqn);
  std::sort(fqns.begin(), fqns.end());
  EXPECT_EQ(fqns, (std::vector<std::string>{"acc", "hits", "table"}));
}

TEST(Session, StartsFromTheTemplates) {
  auto engine = CounterEngine();
  auto session = engine->NewSession();
  for (float v : ReadBuffer<float>(*engine, *session, "acc")) EXPECT_EQ(v, 0.5f);
  for (int64_t v : ReadBuffer<int64_t>(*engine, *session, "hits")) EXPECT_EQ(v, 0);
}

// Interleaves two sessions, then runs a third alone: the results of the
// first equal the third's, whatever the number of lanes.
void CheckInterleavedRuns(const std::shared_ptr<Engine>& engine) {
  auto a = engine->NewSession();
  auto b = engine->NewSession();
  std::vector<std::vector<float>> interleaved_a;
  for (int step = 0; step < 5; ++step) {
    interleaved_a.push_back(RunCounter(*a, 1.0f + step, step % 4));
    RunCounter(*b, -2.0f, 3);
  }
  EXPECT_EQ(ReadBuffer<int64_t>(*engine, *a, "hits"), (std::vector<int64_t>{2, 1, 1, 1}));
  EXPECT_EQ(ReadBuffer<int64_t>(*engine, *b, "hits"), (std::vector<int64_t>{0, 0, 0, 5}));
  auto solo = engine->NewSession();
  for (int step = 0; step < 5; ++step) {
    EXPECT_EQ(RunCounter(*solo, 1.0f + step, step % 4), interleaved_a[step]) << step;
  }
  EXPECT_EQ(engine->stats().runs, 15);
}

std::shared_ptr<Engine> CounterEngineWithLanes(int64_t lanes) {
  EngineOptions options = Mutable({"acc", "hits"});
  options.lanes = lanes;
  return CounterEngine(options);
}

TEST(Session, OneLaneBindsOnEverySwitch) {
  auto engine = CounterEngineWithLanes(1);
  CheckInterleavedRuns(engine);
  // 10 interleaved runs, each a switch, + the solo session's first.
  EXPECT_EQ(engine->stats().binds, 11);
  EXPECT_EQ(engine->stats().lanes, 1);
}

TEST(Session, TwoLanesKeepTwoSessionsBound) {
  auto engine = CounterEngineWithLanes(2);
  CheckInterleavedRuns(engine);
  // a and b keep a lane each; the solo session takes the least recently used.
  EXPECT_EQ(engine->stats().binds, 3);
}

TEST(Session, InterleavedRunsAreIsolated) {
  auto engine = CounterEngine();
  CheckInterleavedRuns(engine);
  // Four lanes by default: a, b and solo each bind once.
  EXPECT_EQ(engine->stats().binds, 3);
}

TEST(Session, ForkResetAndState) {
  auto engine = CounterEngine();
  auto a = engine->NewSession();
  RunCounter(*a, 1.0f, 2);
  auto fork = a->Fork();
  EXPECT_EQ(ReadBuffer<float>(*engine, *fork, "acc"), ReadBuffer<float>(*engine, *a, "acc"));
  RunCounter(*fork, 1.0f, 2);
  EXPECT_EQ(ReadBuffer<int64_t>(*engine, *a, "hits")[2], 1);
  EXPECT_EQ(ReadBuffer<int64_t>(*engine, *fork, "hits")[2], 2);
  a->Reset();
  EXPECT_EQ(ReadBuffer<int64_t>(*engine, *a, "hits"), (std::vector<int64_t>{0, 0, 0, 0}));
  for (float v : ReadBuffer<float>(*engine, *a, "acc")) EXPECT_EQ(v, 0.5f);

  std::vector<float> acc(32, 7.0f);
  std::vector<int64_t> hits{9, 9, 9, 9};
  OwnedTensor acc_t = HostTensor(acc, {4, 8}, "float32");
  OwnedTensor hits_t = HostTensor(hits, {4}, "int64");
  a->WriteBuffers({"hits", "acc"}, {hits_t.get(), acc_t.get()});  // any order
  EXPECT_EQ(ReadBuffer<int64_t>(*engine, *a, "hits"), hits);
  EXPECT_EQ(ReadBuffer<float>(*engine, *a, "acc"), acc);
}

TEST(Session, WriteBuffersIsAllOrNothing) {
  auto engine = CounterEngine();
  auto s = engine->NewSession();
  std::vector<float> acc(32, 7.0f);
  std::vector<float> wrong(4, 1.0f);  // hits must be int64
  OwnedTensor acc_t = HostTensor(acc, {4, 8}, "float32");
  OwnedTensor wrong_t = HostTensor(wrong, {4}, "float32");
  EXPECT_EQ(KindOf([&] { s->WriteBuffers({"acc", "hits"}, {acc_t.get(), wrong_t.get()}); }),
            ErrorKind::kTypeMismatch);
  EXPECT_EQ(KindOf([&] { s->WriteBuffers({"acc"}, {acc_t.get()}); }), ErrorKind::kInvalidArgument);
  EXPECT_EQ(KindOf([&] { s->WriteBuffers({"acc", "acc"}, {acc_t.get(), acc_t.get()}); }),
            ErrorKind::kInvalidArgument);
  for (float v : ReadBuffer<float>(*engine, *s, "acc")) EXPECT_EQ(v, 0.5f);
}

TEST(FailClosed, UndeclaredOrUnknownMutableState) {
  EXPECT_EQ(KindOf([] { CounterEngine(Mutable({"acc", "nope"})); }), ErrorKind::kPackage);
  EngineOptions options = Mutable({"acc"});
  options.known_mutated = {"acc", "hits"};
  EXPECT_EQ(KindOf([&] { CounterEngine(options); }), ErrorKind::kPackage);
}

TEST(FailClosed, MethodsDisagreeOnABuffer) {
  std::vector<MethodSource> methods = OneMethod(ModelPath("AOTI_SESSIONS_COUNTER_SO"));
  methods.push_back(OneMethod(ModelPath("AOTI_SESSIONS_COUNTER_TALL_SO"))[0]);
  methods[1].name = "tall";
  try {
    Engine::Create(methods, Mutable({"acc", "hits"}));
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kPackage);
    std::string msg = e.what();
    EXPECT_NE(msg.find("float32[4, 8]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("float32[6, 8]"), std::string::npos) << msg;
  }
}

TEST(FailClosed, DuplicateMethodNamesAndBadOptions) {
  std::vector<MethodSource> methods = OneMethod(ModelPath("AOTI_SESSIONS_COUNTER_SO"));
  methods.push_back(methods[0]);
  EXPECT_EQ(KindOf([&] { Engine::Create(methods, Mutable({"acc", "hits"})); }),
            ErrorKind::kInvalidArgument);
  EngineOptions options = Mutable({"acc", "hits"});
  options.device = "cuda:0";
#ifndef AOTI_SESSIONS_WITH_CUDA
  EXPECT_EQ(KindOf([&] { CounterEngine(options); }), ErrorKind::kInvalidArgument);
#endif
  options.device = "cpu";
  options.max_sessions = 0;
  EXPECT_EQ(KindOf([&] { CounterEngine(options); }), ErrorKind::kInvalidArgument);
}

TEST(FailClosed, BadInputsLeaveStateUntouched) {
  auto engine = CounterEngine();
  auto s = engine->NewSession();
  RunCounter(*s, 1.0f, 0);
  auto acc_before = ReadBuffer<float>(*engine, *s, "acc");
  // Count.
  EXPECT_EQ(KindOf([&] { s->Run(0, {}); }), ErrorKind::kInvalidArgument);
  // Out-of-range slot: the model's own bounds check fails the run.
  EXPECT_EQ(KindOf([&] { RunCounter(*s, 1.0f, 100); }), ErrorKind::kRun);
  // Unknown method index.
  EXPECT_EQ(KindOf([&] { s->Run(7, {}); }), ErrorKind::kInvalidArgument);
  EXPECT_EQ(ReadBuffer<int64_t>(*engine, *s, "hits")[0], 1);
  EXPECT_EQ(RunCounter(*s, 1.0f, 1).size(), 8u);  // still usable
}

TEST(FailClosed, InputSpecsAreChecked) {
  std::vector<MethodSource> methods = OneMethod(ModelPath("AOTI_SESSIONS_COUNTER_SO"));
  InputSpec x{DtypeFromName("float32"), {1, 8}, {}};
  InputSpec slot{DtypeFromName("int64"), {1}, {}};
  methods[0].inputs = std::vector<InputSpec>{x, slot};
  auto engine = Engine::Create(methods, Mutable({"acc", "hits"}));
  auto s = engine->NewSession();
  std::vector<double> wrong(8, 1.0);
  std::vector<int64_t> zero{0};
  std::vector<OwnedTensor> inputs;
  inputs.push_back(HostTensor(wrong, {1, 8}, "float64"));
  inputs.push_back(HostTensor(zero, {1}, "int64"));
  EXPECT_EQ(KindOf([&] { s->Run(0, std::move(inputs)); }), ErrorKind::kTypeMismatch);
  std::vector<float> wide(16, 1.0f);
  inputs.clear();
  inputs.push_back(HostTensor(wide, {2, 8}, "float32"));
  inputs.push_back(HostTensor(zero, {1}, "int64"));
  EXPECT_EQ(KindOf([&] { s->Run(0, std::move(inputs)); }), ErrorKind::kInvalidArgument);
  EXPECT_EQ(engine->stats().runs, 0);  // refused before the model ran
}

TEST(Capacity, MaxSessionsAndBudget) {
  EngineOptions options = Mutable({"acc", "hits"});
  options.max_sessions = 2;
  auto engine = CounterEngine(options);
  auto a = engine->NewSession();
  auto b = engine->NewSession();
  EXPECT_EQ(KindOf([&] { engine->NewSession(); }), ErrorKind::kCapacity);
  EXPECT_EQ(KindOf([&] { a->Fork(); }), ErrorKind::kCapacity);
  b->Close();
  EXPECT_NO_THROW(engine->NewSession());

  options.max_sessions = std::nullopt;
  options.memory_budget = 1024;  // two 512-byte sessions
  options.host_budget = 0;       // nothing may be offloaded to make room
  auto budgeted = CounterEngine(options);
  auto c = budgeted->NewSession();
  auto d = budgeted->NewSession();
  EXPECT_EQ(KindOf([&] { budgeted->NewSession(); }), ErrorKind::kCapacity);
  EXPECT_EQ(budgeted->stats().live_bytes, 1024);
}

TEST(Lifecycle, ClosedSessionsAndEngines) {
  auto engine = CounterEngine();
  auto s = engine->NewSession();
  s->Close();
  s->Close();
  EXPECT_EQ(KindOf([&] { RunCounter(*s, 1.0f, 0); }), ErrorKind::kSessionClosed);
  EXPECT_EQ(KindOf([&] { s->Reset(); }), ErrorKind::kSessionClosed);
  auto t = engine->NewSession();
  engine->Close();
  EXPECT_TRUE(t->closed());
  EXPECT_EQ(KindOf([&] { engine->NewSession(); }), ErrorKind::kSessionClosed);
  EXPECT_EQ(engine->stats().live_sessions, 0);
}

}  // namespace
}  // namespace aoti_sessions
