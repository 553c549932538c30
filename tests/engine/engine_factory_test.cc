// The engine factory's option parsing, as the server's and tools' flags use it.
#include "server/engine/engine_factory.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace ttt {
namespace {

using Choice = CudaEngineOptions::SingleSequenceKernel;
using ::testing::HasSubstr;

TEST(EngineFactoryTest, ParsesTheSingleSequenceKernelChoices) {
  EXPECT_EQ(ParseSingleSequenceKernel("auto").value(), Choice::kWhereFaster);
  EXPECT_EQ(ParseSingleSequenceKernel("on").value(), Choice::kWhereItFits);
  EXPECT_EQ(ParseSingleSequenceKernel("off").value(), Choice::kOff);
  // Left to the engine unless asked otherwise.
  EXPECT_EQ(EngineOptions{}.single_sequence_kernel, Choice::kWhereFaster);
}

TEST(EngineFactoryTest, RefusesUnknownValuesNamingTheOption) {
  const auto kernel = ParseSingleSequenceKernel("sometimes");
  ASSERT_FALSE(kernel.ok());
  EXPECT_EQ(kernel.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(kernel.status().message(), HasSubstr("single_sequence_kernel: 'sometimes'"));

  const auto precision = ParseWeightPrecision("f16");
  ASSERT_FALSE(precision.ok());
  EXPECT_EQ(precision.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(precision.status().message(), HasSubstr("precision: 'f16'"));
}

}  // namespace
}  // namespace ttt
