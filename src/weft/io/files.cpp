#include "weft/io/files.h"

#include <ftw.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
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

namespace {
int remove_entry(const char* path, const struct stat*, int, struct FTW*) {
  // A file, a link or an emptied directory; one that vanished meanwhile is gone all the same.
  return std::remove(path) == 0 || errno == ENOENT ? 0 : errno;
}
}  // namespace

void remove_tree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    WEFT_CHECK(errno == ENOENT, path, ": cannot remove: ", std::strerror(errno));
    return;
  }
  // Depth first (a directory after its contents), links not followed.
  const int rc = ::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  WEFT_CHECK(rc == 0, path, ": cannot remove: ", std::strerror(rc > 0 ? rc : errno));
}

}  // namespace weft::io
