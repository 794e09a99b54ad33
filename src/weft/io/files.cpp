#include "weft/io/files.h"

#include <filesystem>
#include <fstream>

#include "weft/core/error.h"

namespace weft::io {

void write_text_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    WEFT_CHECK(out, tmp, ": cannot create");
    out << text;
    out.flush();
    WEFT_CHECK(out, tmp, ": write failed");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  WEFT_CHECK(!ec, path, ": cannot rename ", tmp, " over it: ", ec.message());
}

}  // namespace weft::io
