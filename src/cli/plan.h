// `weft plan CONFIG`: without --cluster, the Plan the config resolves to (JSON, as before); with
// --cluster, the layout search (plan/search.h): a table of the best candidates with their
// predicted step time, MFU and memory, why the winner won, the config that reproduces it (TOML
// and --set flags), and the Plan as JSON (--out).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace weft::cli {

// Registers `plan` on `app`; the returned callback runs it (call it after parsing when the
// `plan` subcommand was given). Returns the exit status.
std::function<int()> add_plan(CLI::App& app);

}  // namespace weft::cli
