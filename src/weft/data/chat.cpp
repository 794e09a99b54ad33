#include "weft/data/chat.h"

#include <algorithm>
#include <utility>

#include "weft/core/error.h"

namespace weft::data {
namespace {

constexpr const char* kVicunaSystem =
    "A chat between a curious human and an artificial intelligence assistant. The assistant "
    "gives helpful, detailed, and polite answers to the human's questions.";
constexpr const char* kQwenSystem = "You are a helpful assistant.";

enum class Role { kSystem, kUser, kAssistant };

struct Range {
  size_t begin, end;
};

// The text of a conversation, with where replies / end-of-turns (targets) and user or system
// content (where markers may be) lie, and the template's special strings.
struct Rendered {
  std::string text;
  std::vector<Range> targets;
  std::vector<Range> content;
  std::vector<std::string> specials;
  bool tokenizer_bos = false;  // prepend the tokenizer's BOS (when it adds one)

  void add(const std::string& s) { text += s; }
  void special(const std::string& s) {
    if (std::find(specials.begin(), specials.end(), s) == specials.end()) specials.push_back(s);
    text += s;
  }
  void target(const std::string& s, bool is_special = false) {
    const size_t b = text.size();
    is_special ? special(s) : add(s);
    if (text.size() > b) targets.push_back({b, text.size()});
  }
  void user(const std::string& s) {
    content.push_back({text.size(), text.size() + s.size()});
    text += s;
  }
};

std::string strip(const std::string& s) {
  const char* ws = " \t\n\r\v\f";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(ws) + 1 - b);
}

Role role_of(const std::string& role, size_t index) {
  if (role == "system") return Role::kSystem;
  if (role == "user" || role == "human") return Role::kUser;
  if (role == "assistant" || role == "gpt") return Role::kAssistant;
  WEFT_FAIL("chat: turn ", index, ": unknown role \"", role,
            "\" (expected system, user, assistant, human or gpt)");
}

// Checks the turn order; returns the roles.
std::vector<Role> check_turns(const std::vector<ChatTurn>& turns,
                              const std::vector<ChatMarker>& markers) {
  WEFT_CHECK(!turns.empty(), "chat: no turns");
  std::vector<Role> roles;
  for (size_t i = 0; i < turns.size(); ++i) roles.push_back(role_of(turns[i].role, i));
  const size_t first = roles[0] == Role::kSystem ? 1 : 0;
  WEFT_CHECK(first < roles.size(), "chat: only a system turn");
  for (size_t i = first; i < roles.size(); ++i) {
    const Role want = (i - first) % 2 == 0 ? Role::kUser : Role::kAssistant;
    WEFT_CHECK(roles[i] == want, "chat: turn ", i, " is \"", turns[i].role, "\" but ",
               want == Role::kUser ? "a user" : "an assistant",
               " turn was expected (after an optional system turn, user and assistant turns "
               "alternate, starting with the user)");
  }
  for (size_t m = 0; m < markers.size(); ++m) {
    WEFT_CHECK(!markers[m].text.empty(), "chat: marker ", m, " has empty text");
    WEFT_CHECK(markers[m].count >= 1, "chat: marker \"", markers[m].text, "\" has count ",
               markers[m].count, " (expected >= 1)");
    for (size_t i = 0; i < turns.size(); ++i)
      WEFT_CHECK(
          roles[i] != Role::kAssistant || turns[i].text.find(markers[m].text) == std::string::npos,
          "chat: turn ", i, " (assistant) contains the marker \"", markers[m].text,
          "\": markers are inputs, only user or system turns may hold them");
  }
  return roles;
}

Rendered render(const std::string& name, const std::vector<ChatTurn>& turns,
                const std::vector<ChatMarker>& markers) {
  const std::vector<Role> roles = check_turns(turns, markers);
  const bool has_system = roles[0] == Role::kSystem;
  const size_t first = has_system ? 1 : 0;
  Rendered r;
  if (name == "llava") {
    r.tokenizer_bos = true;
    if (has_system)
      r.user(turns[0].text);
    else
      r.add(kVicunaSystem);
    r.add(" ");
    for (size_t i = first; i < turns.size(); ++i) {
      if (roles[i] == Role::kUser) {
        r.add("USER: ");
        r.user(turns[i].text);
        r.add(" ");
      } else {
        r.add("ASSISTANT: ");
        r.target(turns[i].text);
        r.target("</s>", true);
      }
    }
  } else if (name == "llama2") {
    for (size_t i = first; i < turns.size(); ++i) {
      if (roles[i] == Role::kUser) {
        r.special("<s>");
        r.add("[INST] ");
        std::string content = turns[i].text;
        if (i == first && has_system)
          content = "<<SYS>>\n" + turns[0].text + "\n<</SYS>>\n\n" + content;
        r.user(strip(content));
        r.add(" [/INST]");
      } else {
        r.add(" ");
        r.target(strip(turns[i].text));
        r.target(" ");
        r.target("</s>", true);
      }
    }
  } else if (name == "llama3") {
    r.special("<|begin_of_text|>");
    for (size_t i = 0; i < turns.size(); ++i) {
      const char* role = roles[i] == Role::kSystem ? "system"
                         : roles[i] == Role::kUser ? "user"
                                                   : "assistant";
      r.special("<|start_header_id|>");
      r.add(role);
      r.special("<|end_header_id|>");
      r.add("\n\n");
      if (roles[i] == Role::kAssistant) {
        r.target(strip(turns[i].text));
        r.target("<|eot_id|>", true);
      } else {
        r.user(strip(turns[i].text));
        r.special("<|eot_id|>");
      }
    }
  } else if (name == "chatml") {
    if (!has_system) {
      r.special("<|im_start|>");
      r.add(std::string("system\n") + kQwenSystem);
      r.special("<|im_end|>");
      r.add("\n");
    }
    for (size_t i = 0; i < turns.size(); ++i) {
      const char* role = roles[i] == Role::kSystem ? "system"
                         : roles[i] == Role::kUser ? "user"
                                                   : "assistant";
      r.special("<|im_start|>");
      r.add(std::string(role) + "\n");
      if (roles[i] == Role::kAssistant) {
        r.target(turns[i].text);
        r.target("<|im_end|>", true);
      } else {
        r.user(turns[i].text);
        r.special("<|im_end|>");
      }
      r.add("\n");
    }
  } else if (name == "plain") {
    WEFT_CHECK(!has_system && turns.size() == 2,
               "chat: template plain takes exactly one user "
               "and one assistant turn (got ",
               turns.size(), " turns", has_system ? ", one of them system" : "", ")");
    // The user turn is reduced to its markers, in order (LLaVA keeps only the image).
    std::string kept;
    const std::string& u = turns[0].text;
    for (size_t pos = 0; pos < u.size();) {
      size_t best = 0;
      for (const ChatMarker& m : markers)
        if (u.compare(pos, m.text.size(), m.text) == 0) best = std::max(best, m.text.size());
      if (best == 0) {
        ++pos;
        continue;
      }
      kept += u.substr(pos, best);
      pos += best;
    }
    WEFT_CHECK(!kept.empty(), "chat: template plain: the user turn holds no marker (the image)");
    r.tokenizer_bos = true;
    r.user(kept);
    r.target(turns[1].text);
    r.target("\n");
  } else {
    WEFT_FAIL("chat: unknown template \"", name,
              "\" (known: llava, llama2, llama3, chatml, plain)");
  }
  return r;
}

// Whether the token's source text overlaps one of the (sorted, disjoint, non-empty) ranges; a
// token with no source text counts when its position lies inside one.
bool overlaps(const TokenOffset& t, const std::vector<Range>& ranges) {
  const auto b = static_cast<size_t>(t.begin), e = static_cast<size_t>(t.end);
  auto it = std::partition_point(ranges.begin(), ranges.end(),
                                 [&](const Range& r) { return r.end <= b; });
  if (it == ranges.end()) return false;
  return e == b ? it->begin <= b : it->begin < e;
}

}  // namespace

std::string render_chat(const std::string& template_name, const std::vector<ChatTurn>& turns,
                        const std::vector<ChatMarker>& markers) {
  return render(template_name, turns, markers).text;
}

EncodedChat encode_chat(const TextTokenizer& tok, const std::string& template_name,
                        const std::vector<ChatTurn>& turns,
                        const std::vector<ChatMarker>& markers) {
  const Rendered r = render(template_name, turns, markers);
  for (const std::string& s : r.specials) {
    const std::vector<int64_t> ids = tok.encode(s, true);
    const auto id = tok.token_id(s);
    WEFT_CHECK(id && ids.size() == 1 && ids[0] == *id, "chat: template ", template_name,
               " needs \"", s, "\" to be a special token of the tokenizer");
  }
  // Markers are matched as literal tokens with ids -1, -2, ... (their index), expanded below.
  std::vector<LiteralToken> literals;
  for (size_t m = 0; m < markers.size(); ++m)
    literals.push_back({markers[m].text, -1 - static_cast<int64_t>(m)});
  const std::vector<TokenOffset> tokens = tok.encode_with_offsets(r.text, true, literals);

  EncodedChat out;
  if (r.tokenizer_bos && tok.add_bos && tok.bos_id) {
    out.ids.push_back(*tok.bos_id);
    out.is_target.push_back(0);
  }
  for (size_t k = 0; k < tokens.size(); ++k) {
    const TokenOffset& t = tokens[k];
    if (t.id < 0) {
      const auto m = static_cast<size_t>(-1 - t.id);
      bool in_content = false;
      for (const Range& c : r.content)
        in_content = in_content || (c.begin <= static_cast<size_t>(t.begin) &&
                                    static_cast<size_t>(t.end) <= c.end);
      WEFT_CHECK(in_content, "chat: marker \"", markers[m].text,
                 "\" matched template text, not a user or system turn");
      out.spans.push_back(
          {static_cast<int>(m), static_cast<int64_t>(out.ids.size()), markers[m].count});
      out.ids.insert(out.ids.end(), static_cast<size_t>(markers[m].count), markers[m].token_id);
      out.is_target.insert(out.is_target.end(), static_cast<size_t>(markers[m].count), 0);
      continue;
    }
    out.ids.push_back(t.id);
    out.is_target.push_back(overlaps(t, r.targets) ? 1 : 0);
  }
  return out;
}

}  // namespace weft::data
