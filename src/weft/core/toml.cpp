#include "weft/core/toml.h"

#include <cstdint>

#include "weft/core/error.h"

namespace weft {

namespace {

// Throws on a non-ASCII byte outside quoted strings and comments (see toml.h).
void reject_bare_non_ascii(const std::string& text, const std::string& source) {
  enum { kCode, kComment, kBasic, kLiteral, kMultiBasic, kMultiLiteral } state = kCode;
  int64_t line = 1, column = 0;
  auto starts = [&](size_t i, const char* s) { return text.compare(i, 3, s) == 0; };
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    ++column;
    if (c == '\n') {
      ++line, column = 0;
      if (state == kComment || state == kBasic || state == kLiteral) state = kCode;
      continue;
    }
    switch (state) {
      case kCode:
        if (c == '#') {
          state = kComment;
        } else if (c == '"') {
          state = starts(i, "\"\"\"") ? (i += 2, column += 2, kMultiBasic) : kBasic;
        } else if (c == '\'') {
          state = starts(i, "'''") ? (i += 2, column += 2, kMultiLiteral) : kLiteral;
        } else {
          WEFT_CHECK(c < 0x80, source, ": invalid TOML at line ", line, ", column ", column,
                     ": a non-ASCII character outside a quoted string or comment");
        }
        break;
      case kComment:
        break;
      case kBasic:
      case kMultiBasic:
        if (c == '\\') {
          ++i, ++column;  // the escaped character
        } else if (state == kBasic && c == '"') {
          state = kCode;
        } else if (state == kMultiBasic && starts(i, "\"\"\"")) {
          i += 2, column += 2, state = kCode;
        }
        break;
      case kLiteral:
        if (c == '\'') state = kCode;
        break;
      case kMultiLiteral:
        if (starts(i, "'''")) i += 2, column += 2, state = kCode;
        break;
    }
  }
}

}  // namespace

toml::table parse_toml(const std::string& text, const std::string& source) {
  reject_bare_non_ascii(text, source);
  try {
    return toml::parse(std::string_view(text), std::string_view(source));
  } catch (const toml::parse_error& e) {
    const toml::source_position& at = e.source().begin;
    WEFT_FAIL(source, ": invalid TOML at line ", at.line, ", column ", at.column, ": ",
              e.description());
  }
}

}  // namespace weft
