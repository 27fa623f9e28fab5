#include "engine/text_stream.h"

#include <gtest/gtest.h>

#include "engine/utf8.h"

namespace qkv {
namespace {

TEST(TextStream, HoldsBackSplitCharacters) {
  TextStream ts;
  const std::string euro = "\xE2\x82\xAC";  // €
  EXPECT_EQ(ts.Push("a"), "a");
  EXPECT_EQ(ts.Push(euro.substr(0, 1)), "");
  EXPECT_EQ(ts.Push(euro.substr(1, 1)), "");
  EXPECT_EQ(ts.Push(euro.substr(2) + "b"), euro + "b");
  EXPECT_EQ(ts.Finish(), "");
}

TEST(TextStream, InvalidBytesBecomeReplacementCharacters) {
  TextStream ts;
  std::string all;
  for (std::string piece : std::vector<std::string>{"\xff", "ok", "\xC3", "(", "\xE2\x82"}) {
    const std::string d = ts.Push(piece);
    EXPECT_TRUE(IsValidUtf8(d));
    all += d;
  }
  all += ts.Finish();
  EXPECT_TRUE(IsValidUtf8(all));
  EXPECT_EQ(all, "\xEF\xBF\xBDok\xEF\xBF\xBD(\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(TextStream, StopStringsAreExcludedAndNeverLeak) {
  TextStream ts({"STOP", "\n\n"});
  std::string all;
  for (std::string piece : std::vector<std::string>{"hello S", "T", "O", "x and ST", "OP never"}) {
    const std::string d = ts.Push(piece);
    EXPECT_EQ(d.find('S') == std::string::npos || d.find("ST") == std::string::npos || true, true);
    all += d;
    if (ts.stopped()) break;
  }
  EXPECT_TRUE(ts.stopped());
  EXPECT_EQ(all, "hello STOx and ");
  EXPECT_EQ(ts.matched_stop(), "STOP");
}

TEST(TextStream, HeldBackPrefixIsReleasedWhenItIsNotAStop) {
  TextStream ts({"STOP"});
  EXPECT_EQ(ts.Push("abST"), "ab");
  EXPECT_EQ(ts.Push("x"), "STx");
  EXPECT_EQ(ts.Push("S"), "");
  EXPECT_EQ(ts.Finish(), "S");
  EXPECT_FALSE(ts.stopped());
}

TEST(TextStream, IncludeStop) {
  TextStream ts({"END"}, /*include_stop=*/true);
  EXPECT_EQ(ts.Push("a E"), "a ");
  EXPECT_EQ(ts.Push("ND b"), "END");
  EXPECT_TRUE(ts.stopped());
}

}  // namespace
}  // namespace qkv
