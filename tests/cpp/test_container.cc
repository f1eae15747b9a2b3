// Model library loading and container descriptors.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>

#include "core/container.h"
#include "core/errors.h"
#include "core/runner.h"
#include "test_helpers.h"

namespace aoti_sessions {
namespace {

using testing::ModelPath;

TEST(ModelLibrary, ResolvesTheContainerEntryPoints) {
  auto lib = ModelLibrary::Open(ModelPath("AOTI_SESSIONS_COUNTER_SO"));
  EXPECT_NE(lib->create_with_device, nullptr);
  EXPECT_NE(lib->run, nullptr);
  EXPECT_NE(lib->update_user_managed_pairs, nullptr);
  EXPECT_TRUE(lib->extract_entries != nullptr || lib->extract_map != nullptr);
  EXPECT_FALSE(lib->targets_cuda());
}

TEST(ModelLibrary, RefusesALibraryThatIsNoModel) {
  try {
    ModelLibrary::Open("libm.so.6");
    FAIL() << "libm is not a model";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kPackage);
    EXPECT_NE(std::string(e.what()).find("does not export AOTInductorModelContainerCreateWithDevice"),
              std::string::npos)
        << e.what();
  }
}

TEST(ModelLibrary, RefusesAMissingFile) {
  try {
    ModelLibrary::Open("/nonexistent/model.so");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kPackage);
    EXPECT_NE(std::string(e.what()).find("cannot load model library"), std::string::npos);
  }
}

TEST(ModelLibrary, RefusesATruncatedLibrary) {
  std::string path = ModelPath("AOTI_SESSIONS_COUNTER_SO");
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string truncated = ::testing::TempDir() + "truncated_model.so";
  std::ofstream(truncated, std::ios::binary).write(bytes.data(), bytes.size() / 3);
  try {
    ModelLibrary::Open(truncated);
    FAIL() << "a truncated library must not load";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kPackage);
    EXPECT_NE(std::string(e.what()).find("is truncated or corrupt"), std::string::npos) << e.what();
  }
  std::remove(truncated.c_str());
}

TEST(Container, CapturesConstantDescriptors) {
  auto lib = ModelLibrary::Open(ModelPath("AOTI_SESSIONS_COUNTER_SO"));
  Container container(lib, DeviceSpec::Parse("cpu"), "", true);
  std::map<std::string, ConstantInfo> by_fqn;
  for (const auto& c : container.constants()) by_fqn[c.fqn] = c;
  ASSERT_TRUE(by_fqn.count("acc") && by_fqn.count("hits") && by_fqn.count("table"));
  EXPECT_EQ(by_fqn["acc"].type, abi::ConstantType::kBuffer);
  EXPECT_EQ(by_fqn["acc"].data_size, 4u * 8u * 4u);
  EXPECT_EQ(by_fqn["hits"].dtype, DtypeFromName("int64"));
  EXPECT_EQ(by_fqn["lin.weight"].type, abi::ConstantType::kParameter);
  EXPECT_EQ(container.num_inputs(), 2u);
  EXPECT_EQ(container.num_outputs(), 1u);
  EXPECT_FALSE(container.in_spec().empty());

  auto current = container.CurrentConstants(ErrorKind::kPackage);
  TensorLayout acc = ReadLayout(current.at("acc"));
  EXPECT_EQ(acc.sizes, (std::vector<int64_t>{4, 8}));
  EXPECT_TRUE(acc.dense());
  EXPECT_EQ(acc.span_bytes(), 128u);
  EXPECT_EQ(static_cast<float*>(DataPtr(current.at("acc")))[0], 0.5f);
}

TEST(DeviceSpec, ParsesAndRefuses) {
  EXPECT_EQ(DeviceSpec::Parse("cpu").kind, DeviceKind::kCpu);
  EXPECT_EQ(DeviceSpec::Parse("cuda:3").index, 3);
  EXPECT_EQ(DeviceSpec::Parse("cuda").index, -1);
  for (const char* bad : {"gpu", "cuda:", "cuda:x", "cuda:-1", ""}) {
    EXPECT_THROW(DeviceSpec::Parse(bad), Error) << bad;
  }
}

TEST(TensorLayout, Density) {
  TensorLayout l;
  l.dtype = DtypeFromName("float32");
  l.sizes = {2, 3};
  l.strides = {3, 1};
  EXPECT_TRUE(l.dense());
  l.strides = {1, 2};  // transposed: still dense
  EXPECT_TRUE(l.dense());
  l.strides = {4, 1};  // padded rows
  EXPECT_FALSE(l.dense());
  EXPECT_EQ(l.span_bytes(), (4u + 2u + 1u) * 4u);
}

// The shapes a captured batch runs with: rows 1, 2, 4, then multiples of 8;
// a dynamic page-table width the next power of two; neither past its bound.
TEST(GraphBuckets, RowsAndWidths) {
  const std::vector<std::pair<int64_t, int64_t>> rows = {{1, 1}, {2, 2}, {3, 4}, {5, 8}, {9, 16}, {17, 24}};
  for (const auto& [given, bucket] : rows) EXPECT_EQ(BatchBucket(given, 64), bucket) << given;
  EXPECT_EQ(BatchBucket(7, 6), 7);  // never fewer than the batch
  EXPECT_EQ(BatchBucket(5, 6), 6);
  const std::vector<std::pair<int64_t, int64_t>> widths = {{1, 1}, {3, 4}, {4, 4}, {5, 8}, {12, 16}, {33, 64}};
  for (const auto& [given, bucket] : widths) EXPECT_EQ(WidthBucket(given, 64), bucket) << given;
  EXPECT_EQ(WidthBucket(40, 48), 48);
  EXPECT_EQ(WidthBucket(48, 48), 48);
}

}  // namespace
}  // namespace aoti_sessions
