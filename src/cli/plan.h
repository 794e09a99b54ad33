// `weft plan CONFIG`: without --cluster, the Plan the config resolves to (JSON, as before); with
// --cluster, the layout search (plan/search.h): a table of the best candidates with their
// predicted step time, MFU and memory, why the winner won, the config that reproduces it (TOML
// and --set flags), and the Plan as JSON (--out).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <nlohmann/json_fwd.hpp>

#include "weft/core/spec.h"
#include "weft/plan/simulate.h"

namespace weft::plan {
struct Profile;
}

namespace weft::cli {

// What the FLOP model prices, for `weft plan` and `weft simulate`: unless `full_rows` (or a
// profile, whose costs are measured on its own rows: then the sample it recorded,
// plan::profile_data_shape), the mean sample of the config's dataset (train/data_shape.h) in
// options->data, and the dataset tokenizer's vocabulary for a spec that leaves model.llm.vocab
// unset (options->unset_vocab). Returns options->data.
const plan::DataShape& price_on_data(const Spec& spec, bool full_rows, const plan::Profile* profile,
                                     plan::SimOptions* options);
// One line: what the FLOP model priced ("priced on ..." / "priced on full rows ...").
std::string data_shape_line(const Spec& spec, const plan::DataShape& shape);

// Registers `plan` on `app`; the returned callback runs it (call it after parsing when the
// `plan` subcommand was given). Returns the exit status.
std::function<int()> add_plan(CLI::App& app);

}  // namespace weft::cli
