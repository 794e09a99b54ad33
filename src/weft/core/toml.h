// Parsing TOML text for weft's own files (configs, cluster files, --set values) with one error
// format, around a bug of the toml++ Debian ships (3.3): classifying a non-ASCII character as
// whitespace or not reaches TOML_UNREACHABLE for most code points below U+FEFF (undefined
// behaviour in release builds; found by scripts/fuzz, e.g. "×" where a key or value belongs, or
// after a line-ending backslash in a multi-line string). So toml++ is only ever handed ASCII:
// non-ASCII text inside strings travels as \u escapes (a literal string holding some becomes the
// same basic string), in comments it is dropped, and anywhere else it is an error (TOML allows
// it nowhere else) naming the line.
#pragma once

#include <toml++/toml.h>

#include <string>

namespace weft {

// The document, or weft::Error "<source>: invalid TOML at line L, column C: ...".
toml::table parse_toml(const std::string& text, const std::string& source);

}  // namespace weft
