// Small text files (configs, JSON state, tokenizer files) written atomically: a `.tmp` beside the
// target, then a rename over it, so a reader never sees half a file. Errors name the path.
#pragma once

#include <string>

namespace weft::io {

void write_text_file(const std::string& path, const std::string& text);

}  // namespace weft::io
