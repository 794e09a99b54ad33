// libFuzzer target: the measured-profile reader (plan/profile.h) and what reads a profile: the
// check against the config it was measured for, its data shape, make_plan's cuts on it and a
// simulated step of a two-rank pipeline. Any input must give a result or a weft::Error — never a
// crash, undefined behaviour or another exception. Run from the repository root (scripts/fuzz):
// the config is configs/tiny-vlm.toml, which the seeds (tests/fuzz/profile/) were measured for.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_support.h"
#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/plan/cluster.h"
#include "weft/plan/plan.h"
#include "weft/plan/profile.h"
#include "weft/plan/simulate.h"

namespace {

const weft::Spec& spec() {
  static const weft::Spec s = weft::load_spec("configs/tiny-vlm.toml", {"parallel.llm.pp=2"});
  return s;
}

const weft::plan::Cluster& cluster() {
  static const weft::plan::Cluster c = weft::plan::load_cluster("configs/clusters/cpu-local.toml");
  return c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const weft::plan::Profile p = weft::plan::parse_profile(
        std::string(reinterpret_cast<const char*>(data), size), "fuzz.json");
    weft::plan::profile_data_shape(p, spec());
    const weft::plan::Plan plan = weft::plan::make_plan(spec(), 2, &p);
    weft::plan::simulate(spec(), plan, cluster(), p);
  } catch (const weft::Error& e) {
    weft_fuzz::no_internal_error(e);
  }
  return 0;
}
