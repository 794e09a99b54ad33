// Checkpoints: atomic step directories with a manifest of sizes and checksums. A damaged or
// truncated file is a clear error naming it; a save that died midway leaves only a temporary
// directory, never found, so the previous checkpoint stays the newest and loads verified.
#include "weft/io/checkpoint.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "support/errors.h"
#include "weft/core/error.h"
#include "weft/io/files.h"

namespace fs = std::filesystem;

namespace weft::io {
namespace {

fs::path fresh(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("weft_ckpt_" + std::to_string(::getpid()) + "_" + name);
  weft::io::remove_tree(d);
  return d;
}

Checkpoint sample(float v) {
  return {{{"w", torch::full({64, 64}, v)}, {"b", torch::arange(7).to(torch::kFloat)}},
          {{"exp_avg.w", torch::full({64, 64}, v / 2)}},
          "{\"step\": 1}",
          {}};
}

using testing::error_of;

// remove_tree (std::filesystem::remove_all's stand-in): a whole tree goes, a symbolic link in it
// goes without what it points to, and a missing path is no error.
TEST(Files, RemoveTreeRemovesEverythingAndFollowsNoLink) {
  const fs::path root = fresh("tree"), outside = fresh("outside");
  fs::create_directories(root / "a/b/c");
  fs::create_directories(outside);
  for (const fs::path& f :
       {root / "x.txt", root / "a/y.txt", root / "a/b/c/z.txt", outside / "keep.txt"})
    std::ofstream(f) << "data";
  fs::create_directory_symlink(outside, root / "a/link");
  remove_tree(root.string());
  EXPECT_FALSE(fs::exists(fs::symlink_status(root)));
  EXPECT_TRUE(fs::exists(outside / "keep.txt"));
  remove_tree(root.string());                    // already gone
  remove_tree((outside / "keep.txt").string());  // a single file
  EXPECT_FALSE(fs::exists(outside / "keep.txt"));
  remove_tree(outside.string());
  EXPECT_FALSE(fs::exists(outside));
}

TEST(Checkpoint, RoundTripWithManifest) {
  const fs::path run = fresh("roundtrip");
  const std::string dir = save_checkpoint(run.string(), 5, sample(1.5f), 2);
  EXPECT_TRUE(fs::exists(fs::path(dir) / "manifest.json"));
  EXPECT_EQ(latest_checkpoint(run.string()), dir);
  const Checkpoint c = load_checkpoint(dir);
  ASSERT_EQ(c.model.size(), 2u);
  EXPECT_TRUE(torch::equal(c.model[0].second, torch::full({64, 64}, 1.5f)));
  EXPECT_EQ(c.state_json, "{\"step\": 1}");
}

TEST(Checkpoint, FlippedByteIsNamed) {
  const fs::path run = fresh("flip");
  const std::string dir = save_checkpoint(run.string(), 1, sample(2.0f), 2);
  const fs::path f = fs::path(dir) / "model.safetensors";
  {
    std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(static_cast<std::streamoff>(fs::file_size(f) - 3));
    io.put('\x7f');
  }
  const std::string e = error_of([&] { load_checkpoint(dir); });
  EXPECT_NE(e.find("model.safetensors: checksum"), std::string::npos) << e;
  EXPECT_NE(e.find("damaged"), std::string::npos) << e;
}

TEST(Checkpoint, TruncatedFileIsNamed) {
  const fs::path run = fresh("truncate");
  const std::string dir = save_checkpoint(run.string(), 1, sample(2.0f), 2);
  const fs::path f = fs::path(dir) / "optimizer.safetensors";
  fs::resize_file(f, fs::file_size(f) / 2);
  const std::string e = error_of([&] { load_checkpoint(dir); });
  EXPECT_NE(e.find("optimizer.safetensors: "), std::string::npos) << e;
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
}

// A removed manifest does not switch verification off: the load stops, naming it.
TEST(Checkpoint, MissingManifestIsNamed) {
  const fs::path run = fresh("no_manifest");
  const std::string dir = save_checkpoint(run.string(), 1, sample(2.0f), 2);
  fs::remove(fs::path(dir) / "manifest.json");
  const std::string e = error_of([&] { load_checkpoint(dir); });
  EXPECT_NE(e.find("manifest.json: missing"), std::string::npos) << e;
}

// A newer step directory that lost its state.json is passed over for the older checkpoint.
TEST(Checkpoint, DamagedNewerCheckpointFallsBackToTheOlder) {
  const fs::path run = fresh("no_state");
  const std::string older = save_checkpoint(run.string(), 1, sample(1.0f), 2);
  const std::string newer = save_checkpoint(run.string(), 2, sample(2.0f), 2);
  fs::remove(fs::path(newer) / "state.json");
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(latest_checkpoint(run.string()), older);
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("step_00000002: no state.json, so not a complete checkpoint; using the "
                      "older step_00000001"),
            std::string::npos)
      << said;
  // Quiet where asked (the ranks of a job other than the one that says it).
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(latest_checkpoint(run.string(), false), older);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

// What a kill -9 during a save leaves: a half-written temporary directory. It is never taken
// for a checkpoint; the previous one is still the newest and verifies.
TEST(Checkpoint, InterruptedSaveLeavesThePreviousCheckpoint) {
  const fs::path run = fresh("interrupted");
  const std::string good = save_checkpoint(run.string(), 10, sample(3.0f), 2);
  const fs::path tmp = run / "checkpoints" / ".tmp-step_00000020";
  fs::create_directories(tmp);
  std::ofstream(tmp / "model.safetensors") << "partial";
  EXPECT_EQ(latest_checkpoint(run.string()), good);
  EXPECT_TRUE(torch::equal(load_checkpoint(good).model[0].second, torch::full({64, 64}, 3.0f)));
  // The next save of step 20 replaces the leftover.
  const std::string next = save_checkpoint(run.string(), 20, sample(4.0f), 2);
  EXPECT_EQ(latest_checkpoint(run.string()), next);
  EXPECT_FALSE(fs::exists(tmp));
}

TEST(Checkpoint, KeepsTheNewest) {
  const fs::path run = fresh("keep");
  for (int s = 1; s <= 4; ++s) save_checkpoint(run.string(), s, sample(1.0f * s), 2);
  int n = 0;
  for (const auto& e : fs::directory_iterator(run / "checkpoints")) n += e.is_directory();
  EXPECT_EQ(n, 2);
  EXPECT_EQ(fs::path(latest_checkpoint(run.string())).filename(), "step_00000004");
}

// ZeRO-1 ranges: each rank writes the flat ranges of a chunk it holds (here chunk 1 of 2 of a
// TP split along dim 0: ranks 0 and 1 hold elements [0, 5) and [5, 12) of its 3 x 4); the load
// joins them, from whichever files, into one shard of the whole chunk. Ranges that leave a gap
// or overlap are an error naming the tensor and the elements.
TEST(Checkpoint, FlatRangesOfAChunkAreJoinedOnLoad) {
  const at::Tensor chunk = torch::arange(12, torch::kFloat).view({3, 4});
  const auto save = [&](const std::string& name,
                        const std::vector<std::pair<int64_t, int64_t>>& ranges) {
    const fs::path run = fresh(name);
    const std::string tmp = begin_sharded_checkpoint(run.string(), 1);
    int rank = 0;
    for (const auto& [begin, length] : ranges)
      write_checkpoint_shards(tmp, rank++,
                              {{"optimizer/m",
                                torch::arange(begin, begin + length, torch::kFloat),
                                0,
                                {},
                                1,
                                2,
                                {3, 4},
                                begin}});
    return finish_sharded_checkpoint(run.string(), 1, "{\"step\": 1}", 1);
  };
  const Checkpoint c = load_checkpoint(save("ranges", {{5, 7}, {0, 5}}));
  ASSERT_EQ(c.shards.size(), 1u);
  const TensorShard& s = c.shards[0];
  EXPECT_EQ(s.name, "optimizer/m");
  EXPECT_TRUE(s.shape.empty()) << "joined into the whole chunk";
  EXPECT_EQ(s.rank, 1);
  EXPECT_EQ(s.size, 2);
  EXPECT_TRUE(torch::equal(s.value, chunk));
  const std::string gap = error_of([&] { load_checkpoint(save("ranges_gap", {{0, 5}, {6, 6}})); });
  EXPECT_NE(gap.find("'optimizer/m': chunk 1 has no range for its elements from 5"),
            std::string::npos)
      << gap;
  const std::string overlap = error_of([&] {
    load_checkpoint(save("ranges_overlap", {{0, 6}, {5, 7}}));
  });
  EXPECT_NE(overlap.find("two ranges over its elements from 5"), std::string::npos) << overlap;
  const std::string short_end = error_of([&] { load_checkpoint(save("ranges_end", {{0, 5}})); });
  EXPECT_NE(short_end.find("no range for its elements from 5 of 12"), std::string::npos)
      << short_end;
  const std::string outside = error_of([&] {
    load_checkpoint(save("ranges_outside", {{0, 5}, {5, 7}, {10, 7}}));
  });
  EXPECT_NE(outside.find("bad range layout"), std::string::npos) << outside;
}

}  // namespace
}  // namespace weft::io
