#include "formats/kv_format.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

namespace witcert::formats {
namespace {

TEST(KvFormat, EveryNameParsesToItsKindAndBackToItsName) {
  const std::vector<std::string> names = kv_format_names();
  ASSERT_EQ(names.front(), kFp16);
  ASSERT_EQ(names.back(), kDitherInt8);
  for (const std::string& name : names) {
    const KvFormat f = KvFormat::parse(name);
    EXPECT_EQ(f.name(), name);
    if (name == kFp16) {
      EXPECT_EQ(f.kind(), FormatKind::exact);
      EXPECT_EQ(f, KvFormat());
    } else if (name == kDitherInt8) {
      EXPECT_EQ(f.kind(), FormatKind::dither_int8);
      EXPECT_EQ(f, KvFormat::dither_int8());
    } else {
      EXPECT_EQ(f.kind(), FormatKind::scheme);
      EXPECT_EQ(f.scheme(KvSide::key), &kv_scheme(name, KvSide::key)) << name;
      EXPECT_EQ(f.scheme(KvSide::value), &kv_scheme(name, KvSide::value)) << name;
    }
  }
}

TEST(KvFormat, GroupSchemesKeepTheirPerTokenValueSide) {
  const KvFormat kivi = KvFormat::parse("kivi-2bit");
  EXPECT_GT(kivi.scheme(KvSide::key)->tokens_per_block(), 1);
  EXPECT_EQ(kivi.scheme(KvSide::value)->tokens_per_block(), 1);
}

TEST(KvFormat, UnknownNamesThrowListingEveryFormat) {
  for (const char* bad : {"", "FP16", "q4_0 ", "dither_int8", "q9_0"}) {
    try {
      KvFormat::parse(bad);
      ADD_FAILURE() << "'" << bad << "' parsed";
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("fp16, "), std::string::npos) << what;
      EXPECT_NE(what.find("dither-int8"), std::string::npos) << what;
      EXPECT_NE(what.find("q4_0"), std::string::npos) << what;
    }
  }
}

}  // namespace
}  // namespace witcert::formats
