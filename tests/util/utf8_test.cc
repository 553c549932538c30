// Where a text stops being UTF-8, as the C++ client finds it in what it is asked to send.
#include "server/util/utf8.h"

#include <gtest/gtest.h>

#include <string>

namespace ttt {
namespace {

constexpr size_t kValid = std::string_view::npos;

TEST(FirstInvalidUtf8Test, WellFormedTextHasNone) {
  EXPECT_EQ(FirstInvalidUtf8(""), kValid);
  EXPECT_EQ(FirstInvalidUtf8("a naïve café in 東京 🚀"), kValid);
  EXPECT_EQ(FirstInvalidUtf8("\xF4\x8F\xBF\xBF"), kValid);  // U+10FFFF, the last code point.
}

TEST(FirstInvalidUtf8Test, NamesTheFirstByteOfTheFirstBadSequence) {
  EXPECT_EQ(FirstInvalidUtf8("ok\xFF"), 2u);             // A byte no sequence starts with.
  EXPECT_EQ(FirstInvalidUtf8("\xC3\xA9\xE6\x9D"), 2u);   // é, then a character cut short.
  EXPECT_EQ(FirstInvalidUtf8("\xE6x\xE6\x9D\xB1"), 0u);  // A lead byte before a plain one.
  EXPECT_EQ(FirstInvalidUtf8("ab\xC0\xAF"), 2u);         // Overlong (RFC 3629 forbids C0, C1).
  EXPECT_EQ(FirstInvalidUtf8("\xED\xA0\x80"), 0u);       // A UTF-16 surrogate, U+D800.
  EXPECT_EQ(FirstInvalidUtf8("\xF4\x90\x80\x80"), 0u);   // Past U+10FFFF.
  EXPECT_EQ(FirstInvalidUtf8("x\x80"), 1u);              // A continuation byte alone.
}

}  // namespace
}  // namespace ttt
