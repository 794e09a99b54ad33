// Config → Spec. TOML in, a fully validated Spec out, or a weft::Error naming the file, the key
// path, the offending value and what is allowed. Nothing downstream re-validates.
#pragma once

#include <string>
#include <vector>

#include "weft/core/spec.h"

namespace weft {

// Parses TOML text. `source` names the text in messages (a file path, "<string>").
// `overrides` are "section.key=value" strings applied before validation; the value is parsed as
// a TOML value (so `train.lr=3e-4`, `model.vision.frozen=true`, `data.kind="shapes"`), and a
// bare word that is not valid TOML is taken as a string (`train.precision=fp32`).
Spec parse_spec(const std::string& toml_text, const std::string& source,
                const std::vector<std::string>& overrides = {});

// Reads and parses a file; a missing/unreadable file is an Error naming it.
Spec load_spec(const std::string& path, const std::vector<std::string>& overrides = {});

// Canonical TOML of a Spec: parse_spec(spec_to_toml(s)) reproduces s. Saved in run dirs.
std::string spec_to_toml(const Spec& spec);

}  // namespace weft
