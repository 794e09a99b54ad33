#include "weft/core/toml.h"

#include <cstdint>
#include <cstdio>

#include "weft/core/error.h"

namespace weft {

namespace {

// The text with no byte above 0x7f left, so toml++ never classifies a non-ASCII character:
// inside basic strings each one becomes a \u / \U escape (decoded back to the same text), a
// literal string holding any becomes the equivalent basic string, in comments each becomes '?',
// and anywhere else one is an error (bare keys and values are ASCII in TOML). Newlines are kept,
// so toml++'s line numbers stay right.
std::string ascii_toml(const std::string& text, const std::string& source) {
  enum { kCode, kComment, kBasic, kMultiBasic } state = kCode;
  std::string out;
  out.reserve(text.size());
  int64_t line = 1;
  size_t line_start = 0, at = 0;  // byte offsets: the current line's start, the current byte
  auto fail = [&](const char* what) {
    WEFT_FAIL(source, ": invalid TOML at line ", line, ", column ", at - line_start + 1, ": ",
              what);
  };
  // Decodes the UTF-8 sequence starting at text[i] (a byte >= 0x80); advances i to its last byte.
  auto code_point = [&](size_t& i) -> uint32_t {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    const int extra = c >= 0xf0 && c < 0xf5 ? 3 : c >= 0xe0 ? 2 : c >= 0xc2 && c < 0xe0 ? 1 : -1;
    if (extra < 0 || i + extra >= text.size() + (extra == 0)) fail("invalid UTF-8");
    uint32_t cp = c & (0x3f >> extra);
    for (int k = 1; k <= extra; ++k) {
      if (i + k >= text.size()) fail("invalid UTF-8");
      const unsigned char b = static_cast<unsigned char>(text[i + k]);
      if ((b & 0xc0) != 0x80) fail("invalid UTF-8");
      cp = (cp << 6) | (b & 0x3f);
    }
    i += extra;
    return cp;
  };
  auto escape = [&](uint32_t cp) {
    char buf[16];
    std::snprintf(buf, sizeof buf, cp < 0x10000 ? "\\u%04X" : "\\U%08X", cp);
    out += buf;
  };
  auto starts = [&](size_t i, const char* s) { return text.compare(i, 3, s) == 0; };
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    at = i;
    if (c == '\n') ++line, line_start = i + 1;
    switch (state) {
      case kCode:
        if (c >= 0x80) fail("a non-ASCII character outside a quoted string or comment");
        if (c == '#') {
          state = kComment;
        } else if (c == '"') {
          state = starts(i, "\"\"\"") ? (out += "\"\"", i += 2, kMultiBasic) : kBasic;
        } else if (c == '\'') {  // a literal string: copied, or rewritten as a basic one
          const bool multi = starts(i, "'''");
          const char* close = multi ? "'''" : "'";
          const size_t begin = i + (multi ? 3 : 1);
          size_t end = multi ? text.find(close, begin) : text.find_first_of("'\n", begin);
          if (end == std::string::npos || text[end] != '\'') {  // unterminated: toml++ says so
            const size_t stop = end == std::string::npos ? text.size() : end;
            for (at = begin; at < stop; ++at)
              if (static_cast<unsigned char>(text[at]) >= 0x80)
                fail("a non-ASCII character in an unterminated literal string");
            out.append(text, i, stop - i);
            i = stop - 1;
            continue;
          }
          if (multi)  // a closing ''' may carry up to two more quotes of content
            while (end + 3 < text.size() && text[end + 3] == '\'') ++end;
          const std::string body = text.substr(begin, end - begin);
          bool ascii = true;
          for (char b : body) ascii = ascii && static_cast<unsigned char>(b) < 0x80;
          if (ascii) {
            out.append(text, i, end + std::string(close).size() - i);
            for (size_t j = begin; j < end; ++j)
              if (text[j] == '\n') ++line, line_start = j + 1;
          } else {
            out += multi ? "\"\"\"" : "\"";
            for (size_t j = 0; j < body.size(); ++j) {
              const unsigned char b = static_cast<unsigned char>(body[j]);
              at = begin + j;
              if (b == '\n') ++line, line_start = begin + j + 1;
              if (b == '\\' || b == '"') {
                out += '\\';
                out += static_cast<char>(b);
              } else if (b >= 0x80) {
                size_t k = begin + j;
                escape(code_point(k));
                j = k - begin;
              } else {
                out += static_cast<char>(b);
              }
            }
            out += multi ? "\"\"\"" : "\"";
          }
          i = end + std::string(close).size() - 1;
          continue;
        }
        out += static_cast<char>(c);
        break;
      case kComment:
        if (c == '\n') state = kCode;
        if (c >= 0x80) {
          code_point(i);
          out += '?';
        } else {
          out += static_cast<char>(c);
        }
        break;
      case kBasic:
      case kMultiBasic:
        if (c == '\\') {
          if (i + 1 < text.size() && static_cast<unsigned char>(text[i + 1]) >= 0x80)
            fail("a backslash before a non-ASCII character (not a TOML escape)");
          out += static_cast<char>(c);
          if (i + 1 < text.size()) {
            out += text[++i];
            if (text[i] == '\n') ++line, line_start = i + 1;
          }
        } else if (c >= 0x80) {
          escape(code_point(i));
        } else {
          out += static_cast<char>(c);
          if (state == kBasic && (c == '"' || c == '\n')) state = kCode;
          if (state == kMultiBasic && starts(i, "\"\"\"")) {
            out += "\"\"";
            i += 2;
            state = kCode;
          }
        }
        break;
    }
  }
  return out;
}

}  // namespace

toml::table parse_toml(const std::string& text, const std::string& source) {
  const std::string ascii = ascii_toml(text, source);
  try {
    return toml::parse(std::string_view(ascii), std::string_view(source));
  } catch (const toml::parse_error& e) {
    const toml::source_position& at = e.source().begin;
    WEFT_FAIL(source, ": invalid TOML at line ", at.line, ", column ", at.column, ": ",
              e.description());
  }
}

}  // namespace weft
