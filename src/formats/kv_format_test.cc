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
  int dithered = 0;
  for (const std::string& name : names) {
    const KvFormat f = KvFormat::parse(name);
    EXPECT_EQ(f.name(), name);
    if (name == kFp16) {
      EXPECT_EQ(f.kind(), FormatKind::exact);
      EXPECT_EQ(f, KvFormat());
    } else if (name.starts_with("dither-int")) {
      const int bits = std::stoi(name.substr(10));
      EXPECT_EQ(f.kind(), FormatKind::dither);
      EXPECT_EQ(f.dither_bits(), bits);
      EXPECT_EQ(f, KvFormat::dither(bits));
      ++dithered;
    } else {
      EXPECT_EQ(f.kind(), FormatKind::scheme);
      EXPECT_EQ(f.scheme(KvSide::key), &kv_scheme(name, KvSide::key)) << name;
      EXPECT_EQ(f.scheme(KvSide::value), &kv_scheme(name, KvSide::value)) << name;
    }
  }
  EXPECT_EQ(dithered, 4) << "dither-int4, -int5, -int6 and -int8";
  EXPECT_EQ(KvFormat::dither(), KvFormat::parse(kDitherInt8));
  for (int bad : {0, 1, 2, 3, 7, 9, 16}) EXPECT_THROW(KvFormat::dither(bad), std::invalid_argument) << bad;
}

TEST(KvFormat, GroupSchemesKeepTheirPerTokenValueSide) {
  const KvFormat kivi = KvFormat::parse("kivi-2bit");
  EXPECT_GT(kivi.scheme(KvSide::key)->tokens_per_block(), 1);
  EXPECT_EQ(kivi.scheme(KvSide::value)->tokens_per_block(), 1);
}

TEST(KvFormat, UnknownNamesThrowListingEveryFormat) {
  for (const char* bad : {"", "FP16", "q4_0 ", "dither_int8", "q9_0", "dither-int3", "dither-int7", "dither-int"}) {
    try {
      KvFormat::parse(bad);
      ADD_FAILURE() << "'" << bad << "' parsed";
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("fp16, "), std::string::npos) << what;
      EXPECT_NE(what.find("dither-int4, dither-int5, dither-int6, dither-int8"), std::string::npos) << what;
      EXPECT_NE(what.find("q4_0"), std::string::npos) << what;
    }
  }
}

}  // namespace
}  // namespace witcert::formats
