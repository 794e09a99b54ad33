// `weft inspect ...`: look inside what weft would do, without running it.
#pragma once

#include <CLI/CLI.hpp>

namespace weft::cli {

// Registers `inspect` and its subcommands on `app`; the returned callback runs the chosen one
// (call it after parsing when the `inspect` subcommand was given). Returns the exit status.
std::function<int()> add_inspect(CLI::App& app);

}  // namespace weft::cli
