// Inputs found by scripts/fuzz, kept as regressions: the config and cluster parsers turn each
// into a Spec / Cluster or a weft::Error, never a crash or another exception; the profile and
// Plan readers likewise, with a simulated step of what they accept (as their fuzz targets run),
// and the Hugging Face config.json reader.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/core/hf_config.h"
#include "weft/plan/cluster.h"
#include "weft/plan/plan.h"
#include "weft/plan/profile.h"
#include "weft/plan/search.h"
#include "weft/plan/simulate.h"

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

TEST(FuzzRegressions, HfConfigReader) {
  const fs::path dir = fs::path(WEFT_SOURCE_DIR) / "tests/fuzz/hf_config";
  int64_t read = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string path = e.path().string();
    for (bool llm : {true, false}) {
      try {
        if (llm)
          weft::read_hf_llm_config(path);
        else
          weft::read_hf_encoder_config(path);
        ++read;
      } catch (const Error& err) {
        EXPECT_NE(std::string(err.what()).find(path), std::string::npos) << err.what();
      }
    }
  }
  EXPECT_GT(read, 0) << "the seeds are configs it reads";
}

// The profile and Plan targets' config (the profile's with the LLM in two stages) and cluster.
const Spec& tiny_vlm(bool pp2) {
  const std::string path = std::string(WEFT_SOURCE_DIR) + "/configs/tiny-vlm.toml";
  static const Spec plain = load_spec(path), two = load_spec(path, {"parallel.llm.pp=2"});
  return pp2 ? two : plain;
}
const plan::Cluster& cpu_local() {
  static const plan::Cluster c =
      plan::load_cluster(std::string(WEFT_SOURCE_DIR) + "/configs/clusters/cpu-local.toml");
  return c;
}

TEST(FuzzRegressions, ProfileReader) {
  const auto all = inputs("profile");
  ASSERT_FALSE(all.empty());
  const Spec& spec = tiny_vlm(true);
  int64_t simulated = 0;
  for (const auto& [name, text] : all) {
    try {
      const plan::Profile p = plan::parse_profile(text, name);
      plan::profile_data_shape(p, spec);
      const plan::Plan plan = plan::make_plan(spec, 2, &p);
      EXPECT_GT(plan::simulate(spec, plan, cpu_local(), p).step_seconds, 0) << name;
      ++simulated;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find("internal error"), std::string::npos) << e.what();
    }
  }
  EXPECT_GT(simulated, 0) << "the seeds are profiles it simulates";
}

TEST(FuzzRegressions, PlanReader) {
  const auto all = inputs("plan");
  ASSERT_FALSE(all.empty());
  const Spec& spec = tiny_vlm(false);
  int64_t simulated = 0;
  for (const auto& [name, text] : all) {
    plan::Plan plan;
    try {
      plan = plan::plan_from_json(text, name, spec);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
      continue;
    }
    try {  // a plan for more ranks than the cluster has is the simulator's Error
      EXPECT_GT(
          plan::simulate(spec, plan, cpu_local(), plan::planner_costs(spec, plan)).step_seconds, 0)
          << name;
      ++simulated;
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).find("internal error"), std::string::npos) << e.what();
    }
  }
  EXPECT_GT(simulated, 0) << "the seeds are plans it simulates";
}

}  // namespace
}  // namespace weft
