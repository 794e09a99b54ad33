// dist::intra_op_threads: a rank's share of the cores it may run on, among the ranks on its
// machine (LOCAL_WORLD_SIZE), or the threads the config asks for; a malformed LOCAL_WORLD_SIZE
// is refused by name.
#include <gtest/gtest.h>
#include <sched.h>

#include <cstdlib>
#include <string>

#include "weft/core/error.h"
#include "weft/dist/launch.h"

namespace weft::dist {
namespace {

// Sets LOCAL_WORLD_SIZE for the test's scope (unset: nullptr), and restores it.
class LocalWorldSize {
 public:
  explicit LocalWorldSize(const char* value) {
    if (const char* v = std::getenv("LOCAL_WORLD_SIZE")) saved_ = v, had_ = true;
    value ? ::setenv("LOCAL_WORLD_SIZE", value, 1) : ::unsetenv("LOCAL_WORLD_SIZE");
  }
  ~LocalWorldSize() {
    had_ ? ::setenv("LOCAL_WORLD_SIZE", saved_.c_str(), 1) : ::unsetenv("LOCAL_WORLD_SIZE");
  }

 private:
  std::string saved_;
  bool had_ = false;
};

int affinity_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(::sched_getaffinity(0, sizeof set, &set), 0);
  return CPU_COUNT(&set);
}

TEST(Threads, ShareOfTheCoresAmongLocalRanks) {
  const int cores = affinity_cores();
  ASSERT_GE(cores, 1);
  {
    const LocalWorldSize none(nullptr);
    EXPECT_EQ(intra_op_threads(0), cores);
    EXPECT_EQ(intra_op_threads(3), 3);  // asked for: as is
  }
  {
    const LocalWorldSize two("2");
    EXPECT_EQ(intra_op_threads(0), std::max(1, cores / 2));
    EXPECT_EQ(intra_op_threads(5), 5);
  }
  {
    const LocalWorldSize many("4096");  // more ranks than cores: one thread each
    EXPECT_EQ(intra_op_threads(0), 1);
  }
  {
    const LocalWorldSize huge("4294967296");  // past an int: still one thread each
    EXPECT_EQ(intra_op_threads(0), 1);
  }
  for (const char* bad : {"0", "-2", "two", "2x"}) {
    const LocalWorldSize b(bad);
    try {
      intra_op_threads(0);
      ADD_FAILURE() << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("LOCAL_WORLD_SIZE = \"" + std::string(bad) + "\""),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(intra_op_threads(2), 2);  // asked for: the variable is not read
  }
}

}  // namespace
}  // namespace weft::dist
