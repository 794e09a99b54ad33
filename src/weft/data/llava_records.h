// LLaVA-style records (data/llava.h) parsed from the text of a JSON array or a JSONL file, with
// every field checked: errors name the file, the record (and line, for JSONL) and the field.
// Torch-free (fuzzed by fuzz/llava_fuzz.cpp).
#pragma once

#include <string>
#include <vector>

#include "weft/data/chat.h"

namespace weft::data {

struct LlavaRecord {
  std::vector<std::string> images, audios;  // as written (relative to data.root)
  std::vector<ChatTurn> turns;              // roles: system, user, assistant
};

std::vector<LlavaRecord> parse_llava_records(const std::string& text, const std::string& file);

}  // namespace weft::data
