// Small text files (configs, JSON state, tokenizer files) written atomically: a `.tmp` beside the
// target, then a rename over it, so a reader never sees half a file. Errors name the path.
#pragma once

#include <string>

namespace weft::io {

void write_text_file(const std::string& path, const std::string& text);

// Removes `path` and everything under it (nothing when it does not exist); symbolic links are
// removed, not followed. Errors name the path. Used instead of std::filesystem::remove_all: pip's
// LibTorch exports its own copy of that function, which crashes on a non-empty directory, and a
// program linked against it may have its calls bound to that copy.
void remove_tree(const std::string& path);

}  // namespace weft::io
