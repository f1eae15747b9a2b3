// PoolLayout::Add: the rules across pooled methods (one layout for every
// pooled tensor), on method descriptions alone (no compiled model).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/errors.h"
#include "core/model.h"

namespace aoti_sessions {
namespace {

constexpr int32_t kFloat32 = 6;  // torch's dtype code (c10::ScalarType::Float)
constexpr int32_t kInt32 = 3;
constexpr int32_t kInt64 = 4;

// A method's inputs: a [rows, T] token input (0), a page tensor "k" of
// [pages, page_size, width] (1), a [rows, max_pages] page table (2), [rows]
// positions (3) and, with `slot`, a slot tensor "s" of [slots, 4] (4) and slot ids (5).
struct Described {
  PoolSource source;
  std::vector<InputSpec> inputs;
};

Described Method(int64_t page_size, int64_t max_pages, int64_t width, bool slot = false) {
  Described d;
  d.inputs = {{kInt64, {-1, -1}, {}},
              {kFloat32, {64, page_size, width}, {}},
              {kInt32, {-1, max_pages}, {}},
              {kInt64, {-1}, {}}};
  d.source.page_size = page_size;
  d.source.tensors = {{1, "k", PoolKind::kPages}};
  d.source.page_table = 2;
  d.source.positions = 3;
  d.source.max_rows = 4;
  if (slot) {
    d.inputs.push_back({kFloat32, {8, 4}, {}});
    d.inputs.push_back({kInt32, {-1}, {}});
    d.source.tensors.push_back({4, "s", PoolKind::kSlots});
    d.source.slot_ids = 5;
  }
  return d;
}

std::string MessageOf(PoolLayout& layout, const std::string& name, const Described& d) {
  try {
    layout.Add(name, d.source, d.inputs);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kPackage);
    return e.what();
  }
  ADD_FAILURE() << "no error thrown";
  return "";
}

TEST(PoolLayout, MethodsThatAgreeShareOneLayout) {
  PoolLayout layout;
  Described decode = Method(16, 8, 32, /*slot=*/true);
  Described prefill = Method(16, 8, 32, /*slot=*/true);
  prefill.source.max_rows = 2;
  EXPECT_EQ(layout.Add("decode", decode.source, decode.inputs), (std::vector<size_t>{0, 1}));
  // Listed in another order, the same tensors keep their indices.
  std::swap(prefill.source.tensors[0], prefill.source.tensors[1]);
  EXPECT_EQ(layout.Add("prefill", prefill.source, prefill.inputs), (std::vector<size_t>{1, 0}));
  EXPECT_EQ(layout.from, "decode");
  EXPECT_EQ(layout.page_size, 16);
  EXPECT_EQ(layout.max_pages, 8);
  EXPECT_EQ(layout.max_rows, 4);
  ASSERT_EQ(layout.tensors.size(), 2u);
  EXPECT_EQ(layout.tensors[0].unit.sizes, (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(layout.page_bytes, 16u * 32u * 4u);
  EXPECT_EQ(layout.slot_bytes, 4u * 4u);
  EXPECT_EQ(layout.max_positions(), 128);
}

TEST(PoolLayout, DisagreementsNameBothMethods) {
  PoolLayout layout;
  Described decode = Method(16, 8, 32, /*slot=*/true);
  layout.Add("decode", decode.source, decode.inputs);
  EXPECT_NE(MessageOf(layout, "prefill", Method(16, 4, 32)).find(
                "method 'prefill' and method 'decode' disagree on the pooled state: page tables of 4 and 8 pages"),
            std::string::npos);
  Described pages = Method(8, 8, 32);
  EXPECT_NE(MessageOf(layout, "prefill", pages).find("pages of 8 and 16 positions"), std::string::npos);
  EXPECT_NE(MessageOf(layout, "prefill", Method(16, 8, 64)).find("'k' is float32[16, 32]"), std::string::npos);
  Described kind = Method(16, 8, 32, /*slot=*/true);
  kind.source.tensors[1].kind = PoolKind::kPages;
  EXPECT_NE(MessageOf(layout, "prefill", kind).find("pages in one and slots in the other"), std::string::npos);
}

TEST(PoolLayout, RefusesAPooledTensorThatIsNotContiguous) {
  PoolLayout layout;
  Described strided = Method(16, 8, 32);
  strided.inputs[1].strides = {1024, 1, 16};
  EXPECT_NE(MessageOf(layout, "decode", strided).find("method 'decode': pooled tensor 'k' must be contiguous"),
            std::string::npos);
}

}  // namespace
}  // namespace aoti_sessions
