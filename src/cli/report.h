// `weft report RUN_DIR_OR_SIM_JSON [--sim SIM.json] [--out FILE.html]`: one self-contained HTML
// page (inline SVG and CSS; no scripts, no network) about a training run or a simulated step:
//   run directory   the loss curve, throughput and MFU per step, the per-microbatch balance
//                   (metrics.jsonl: microbatch_imbalance, cp_imbalance), the run's plan, and the
//                   pipeline timeline of the traced step (trace.json)
//   simulation      `weft simulate --trace T.json` output: the predicted step, its per-rank time
//                   and memory, and its timeline (the trace file the JSON names)
// With --sim the predicted timeline is drawn under the measured one on the same time axis.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace weft::cli {

// Registers `report` on `app`; the returned callback runs it (call it after parsing when the
// `report` subcommand was given). Returns the exit status.
std::function<int()> add_report(CLI::App& app);

}  // namespace weft::cli
