// libFuzzer target: the Plan file reader (plan/plan.h plan_from_json, `weft simulate --plan`)
// against a config, and a simulated step of what it accepts. Any input must give a result or a
// weft::Error — never a crash, undefined behaviour or another exception. Run from the repository
// root (scripts/fuzz): the config is configs/tiny-vlm.toml, the seeds' (tests/fuzz/plan/).
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_support.h"
#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/plan/cluster.h"
#include "weft/plan/plan.h"
#include "weft/plan/search.h"
#include "weft/plan/simulate.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const weft::Spec spec = weft::load_spec("configs/tiny-vlm.toml");
  static const weft::plan::Cluster cluster =
      weft::plan::load_cluster("configs/clusters/cpu-local.toml");
  try {
    const weft::plan::Plan plan = weft::plan::plan_from_json(
        std::string(reinterpret_cast<const char*>(data), size), "fuzz.json", spec);
    weft::plan::simulate(spec, plan, cluster, weft::plan::planner_costs(spec, plan, {}));
  } catch (const weft::Error& e) {
    weft_fuzz::no_internal_error(e);
  }
  return 0;
}
