#include "weft/data/llava_records.h"

#include <nlohmann/json.hpp>
#include <sstream>

#include "weft/core/error.h"

namespace weft::data {

using json = nlohmann::json;

namespace {

// "image": "a.jpg" | ["a.jpg", ...] | absent.
std::vector<std::string> paths_of(const json& r, const char* key, const std::string& where) {
  std::vector<std::string> out;
  if (!r.contains(key) || r[key].is_null()) return out;
  const json& v = r[key];
  if (v.is_string()) return {v.get<std::string>()};
  WEFT_CHECK(v.is_array(), where, ": \"", key, "\" must be a path or a list of paths");
  for (const json& p : v) {
    WEFT_CHECK(p.is_string(), where, ": \"", key, "\" entries must be strings");
    out.push_back(p.get<std::string>());
  }
  return out;
}

LlavaRecord parse_record(const json& r, const std::string& where) {
  WEFT_CHECK(r.is_object(), where, ": expected an object");
  LlavaRecord rec;
  rec.images = paths_of(r, "image", where);
  rec.audios = paths_of(r, "audio", where);
  WEFT_CHECK(
      r.contains("conversations") && r["conversations"].is_array() && !r["conversations"].empty(),
      where, ": \"conversations\" must be a non-empty list of {from, value}");
  const json& turns = r["conversations"];
  for (size_t t = 0; t < turns.size(); ++t) {
    const std::string at = where + ": conversations[" + std::to_string(t) + "]";
    WEFT_CHECK(turns[t].is_object() && turns[t].contains("from") && turns[t]["from"].is_string() &&
                   turns[t].contains("value") && turns[t]["value"].is_string(),
               at, ": expected {\"from\": string, \"value\": string}");
    const std::string from = turns[t]["from"].get<std::string>();
    std::string role = from == "human" || from == "user"      ? "user"
                       : from == "gpt" || from == "assistant" ? "assistant"
                       : from == "system"                     ? "system"
                                                              : "";
    WEFT_CHECK(!role.empty(), at, ".from = \"", from,
               "\": expected human, gpt, user, assistant or system");
    rec.turns.push_back({role, turns[t]["value"].get<std::string>()});
  }
  return rec;
}

}  // namespace

std::vector<LlavaRecord> parse_llava_records(const std::string& s, const std::string& file) {
  const size_t first = s.find_first_not_of(" \t\r\n");
  std::vector<LlavaRecord> out;
  if (first != std::string::npos && s[first] == '[') {  // one JSON array
    json j = json::parse(s, nullptr, /*allow_exceptions=*/false);
    WEFT_CHECK(!j.is_discarded(), file,
               ": not valid JSON (a JSON array of records, or JSONL: one record per line)");
    for (size_t k = 0; k < j.size(); ++k)
      out.push_back(parse_record(j[k], file + ": record " + std::to_string(k)));
  } else {  // JSONL
    std::istringstream lines(s);
    std::string line;
    for (int64_t n = 1; std::getline(lines, line); ++n) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      json j = json::parse(line, nullptr, false);
      const std::string where =
          file + ":" + std::to_string(n) + ": record " + std::to_string(out.size());
      WEFT_CHECK(!j.is_discarded(), where, ": not valid JSON (a truncated file?)");
      out.push_back(parse_record(j, where));
    }
  }
  WEFT_CHECK(!out.empty(), file, ": no records");
  return out;
}

}  // namespace weft::data
