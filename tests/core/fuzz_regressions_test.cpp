// Inputs found by scripts/fuzz, kept as regressions: the config and cluster parsers turn each
// into a Spec / Cluster or a weft::Error, never a crash or another exception.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/plan/cluster.h"
#include "weft/plan/plan.h"

namespace fs = std::filesystem;

namespace weft {
namespace {

std::vector<std::pair<std::string, std::string>> inputs(const std::string& target) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& e : fs::directory_iterator(fs::path(WEFT_SOURCE_DIR) / "tests/fuzz" / target)) {
    std::ifstream in(e.path(), std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    out.emplace_back(e.path().filename().string(), ss.str());
  }
  return out;
}

TEST(FuzzRegressions, ConfigParser) {
  const auto all = inputs("config");
  ASSERT_FALSE(all.empty());
  for (const auto& [name, text] : all) {
    try {
      plan::make_plan(parse_spec(text, name, {}), 1);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  }
}

TEST(FuzzRegressions, ClusterParser) {
  const auto all = inputs("cluster");
  ASSERT_FALSE(all.empty());
  for (const auto& [name, text] : all) {
    try {
      plan::parse_cluster(text, name);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace weft
