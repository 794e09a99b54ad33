// Parsing TOML text for weft's own files (configs, cluster files, --set values) with one error
// format, behind a guard for a bug of the toml++ Debian ships (3.3): a non-ASCII character
// where the parser tests for whitespace reaches TOML_UNREACHABLE (undefined behaviour in
// release builds; found by scripts/fuzz). TOML allows non-ASCII text only inside quoted strings
// and comments, so such a character is rejected first with its line and column.
#pragma once

#include <toml++/toml.h>

#include <string>

namespace weft {

// The document, or weft::Error "<source>: invalid TOML at line L, column C: ...".
toml::table parse_toml(const std::string& text, const std::string& source);

}  // namespace weft
