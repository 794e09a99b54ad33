// `weft simulate CONFIG --cluster CLUSTER`: predict one training step of the config's Plan on a
// cluster (plan/simulate.h) — JSON on stdout, optionally a Chrome/Perfetto trace of the timeline.
#pragma once

#include <CLI/CLI.hpp>

namespace weft::cli {

// Registers `simulate` on `app`; the returned callback runs it (call it after parsing when the
// `simulate` subcommand was given). Returns the exit status.
std::function<int()> add_simulate(CLI::App& app);

}  // namespace weft::cli
