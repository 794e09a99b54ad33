// Checkpoints: atomic step directories with a manifest of sizes and checksums. A damaged or
// truncated file is a clear error naming it; a save that died midway leaves only a temporary
// directory, never found, so the previous checkpoint stays the newest and loads verified.
#include "weft/io/checkpoint.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <tuple>

#include "support/errors.h"
#include "weft/core/error.h"
#include "weft/io/files.h"
#include "weft/model/layers.h"

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
          "{\"step\": 1}"};
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
// TP split along dim 0: ranks 1 and 2 hold elements [0, 5) and [5, 12) of its 3 x 4; rank 0
// wrote chunk 0 whole); the load joins them, from whichever files, into the whole tensor.
// Ranges that leave a gap or overlap, and a missing chunk, are errors naming the tensor and what
// is wrong.
TEST(Checkpoint, FlatRangesOfAChunkAreJoinedOnLoad) {
  const at::Tensor chunk0 = torch::arange(100, 112, torch::kFloat).view({3, 4});
  const at::Tensor chunk1 = torch::arange(12, torch::kFloat).view({3, 4});
  const auto save = [&](const std::string& name,
                        const std::vector<std::pair<int64_t, int64_t>>& ranges,
                        int chunk0_copies = 1) {
    const fs::path run = fresh(name);
    const std::string tmp = begin_sharded_checkpoint(run.string(), 1);
    int rank = 0;
    for (int k = 0; k < chunk0_copies; ++k)
      write_checkpoint_shards(tmp, rank++, {{"optimizer/m", chunk0, 0, {}, 0, 2, {}, 0}});
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
  ASSERT_EQ(c.optimizer.size(), 1u);
  EXPECT_TRUE(c.model.empty());
  EXPECT_EQ(c.optimizer[0].first, "m");
  EXPECT_TRUE(torch::equal(c.optimizer[0].second, torch::cat({chunk0, chunk1})));
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
  // A chunk written whole twice (a tensor TP replicates, as older checkpoints hold it) loads.
  EXPECT_TRUE(torch::equal(load_checkpoint(save("chunk_twice", {{0, 12}}, 2)).optimizer[0].second,
                           torch::cat({chunk0, chunk1})));
  // Segments that do not tile the dim, even of a tensor written whole.
  const fs::path run = fresh("bad_segments");
  const std::string tmp = begin_sharded_checkpoint(run.string(), 1);
  write_checkpoint_shards(tmp, 0, {{"model/w", torch::zeros({4, 3}), 0, {2}, 0, 1, {}, 0}});
  const std::string segments = error_of(
      [&] { load_checkpoint(finish_sharded_checkpoint(run.string(), 1, "{\"step\": 1}", 1)); });
  EXPECT_NE(segments.find("tensor 'model/w': segments [2] do not split 4 entries over 1 chunks"),
            std::string::npos)
      << segments;
  const std::string missing = error_of([&] {
    load_checkpoint(save("chunk_missing", {{0, 12}}, 0));
  });
  EXPECT_NE(missing.find("tensor 'optimizer/m' has 1 of its 2 shards"), std::string::npos)
      << missing;
}

// A random split of a dim of `extent` (a multiple of 6) over `size` (1 to 3): the whole dim, or
// segments (a fused QKV's) that each split evenly.
std::vector<int64_t> random_segments(std::mt19937& rng, int64_t extent) {
  if (extent < 12 || rng() % 2 == 0) return {};
  const int64_t first = 6 * static_cast<int64_t>(1 + rng() % (extent / 6 - 1));
  return {first, extent - first};
}

// Any shard of any tensor from any layout that wrote it: a tensor split along any dim (in
// segments or not) over 1 to 3 ranks, some chunks written whole and some as ZeRO-1 flat ranges
// in two rank files, read back as any other split and as any flat range of that shard, equals
// the same part of the whole tensor (model::take_shard). A small max_span makes reads split
// their spans.
TEST(CheckpointReader, ReadsAnyShardFromAnyLayout) {
  std::mt19937 rng(7);
  const auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<int64_t> shape(static_cast<size_t>(pick(1, 3)));
    for (int64_t& d : shape) d = 6 * pick(1, 3);
    const at::Tensor full =
        torch::randn(shape).to(trial % 3 == 0 ? torch::kBFloat16 : torch::kFloat);
    const int64_t dims = static_cast<int64_t>(shape.size());
    const model::Split wrote{pick(0, dims - 1), {}, 0, pick(1, 3)};
    model::Split written = wrote;
    written.segments = random_segments(rng, shape[written.dim]);

    const fs::path run = fresh("any_shard");
    const std::string tmp = begin_sharded_checkpoint(run.string(), 1);
    for (int64_t r = 0; r < written.size; ++r) {
      model::Split s = written;
      s.rank = r;
      const at::Tensor chunk = model::take_shard(full, s).contiguous();
      const TensorShard whole{"model/t", chunk, s.dim, s.segments, r, s.size, {}, 0};
      if (pick(0, 1) == 0) {
        write_checkpoint_shards(tmp, static_cast<int>(r), {whole});
        continue;
      }
      const int64_t cut = pick(0, chunk.numel());
      const at::Tensor flat = chunk.view({-1});
      for (auto [file, begin, end] : {std::tuple<int64_t, int64_t, int64_t>{r, 0, cut},
                                      {written.size + r, cut, chunk.numel()}})
        write_checkpoint_shards(tmp, static_cast<int>(file),
                                {{"model/t", flat.narrow(0, begin, end - begin).clone(), s.dim,
                                  s.segments, r, s.size, chunk.sizes().vec(), begin}});
    }
    const std::string dir = finish_sharded_checkpoint(run.string(), 1, "{\"step\": 1}", 1);
    const CheckpointReader reader(dir, pick(1, 64));
    EXPECT_EQ(reader.shape("model/t"), shape);
    for (int read = 0; read < 6; ++read) {
      model::Split want{pick(0, dims - 1), {}, 0, pick(1, 3)};
      want.rank = pick(0, want.size - 1);
      want.segments = random_segments(rng, shape[want.dim]);
      const ShardSplit split{want.dim, want.segments, want.rank, want.size};
      const at::Tensor expected = model::take_shard(full, want).contiguous();
      const std::string what = "trial " + std::to_string(trial) + " read " + std::to_string(read);
      EXPECT_TRUE(torch::equal(reader.read("model/t", split), expected)) << what;
      const int64_t begin = pick(0, expected.numel());
      const int64_t length = pick(0, expected.numel() - begin);
      EXPECT_TRUE(torch::equal(reader.read("model/t", split, begin, length),
                               expected.view({-1}).narrow(0, begin, length)))
          << what << " elements [" << begin << ", " << begin + length << ")";
    }
  }
}

// A resuming rank reads its part, not the model: a shard in whole rows of what was written reads
// exactly its bytes, as does a ZeRO-1 piece of a chunk written as ranges in two files; a shard
// across the rows (a row-parallel weight from a checkpoint split by rows) reads spans of at most
// twice what they fill. A file's checksum is checked when data is first read from it.
TEST(CheckpointReader, ReadsOnlyWhatTheShardNeeds) {
  const at::Tensor full = torch::randn({64, 96});
  const fs::path run = fresh("only_needed");
  const std::string tmp = begin_sharded_checkpoint(run.string(), 1);
  for (int64_t r = 0; r < 2; ++r) {
    const at::Tensor chunk = full.narrow(0, 32 * r, 32).contiguous();
    const std::vector<int64_t> shape = chunk.sizes().vec();
    write_checkpoint_shards(tmp, static_cast<int>(r),
                            {{"model/w", chunk, 0, {}, r, 2, {}, 0},
                             {"optimizer/exp_avg.w",
                              chunk.view({-1}).narrow(0, 0, 1000).clone(),
                              0,
                              {},
                              r,
                              2,
                              shape,
                              0}});
    write_checkpoint_shards(tmp, static_cast<int>(2 + r),
                            {{"optimizer/exp_avg.w",
                              chunk.view({-1}).narrow(0, 1000, 2072).clone(),
                              0,
                              {},
                              r,
                              2,
                              shape,
                              1000}});
  }
  const std::string dir = finish_sharded_checkpoint(run.string(), 1, "{\"step\": 1}", 1);
  {
    const CheckpointReader reader(dir, 64);
    EXPECT_EQ(reader.bytes_read(), 0u) << "opening reads no tensor data";
    EXPECT_TRUE(torch::equal(reader.read("model/w", {0, {}, 1, 4}), full.narrow(0, 16, 16)));
    EXPECT_EQ(reader.bytes_read(), 16u * 96 * 4);
    const at::Tensor piece = reader.read("optimizer/exp_avg.w", {0, {}, 1, 2}, 500, 700);
    EXPECT_TRUE(torch::equal(piece, full.narrow(0, 32, 32).reshape({-1}).narrow(0, 500, 700)));
    EXPECT_EQ(reader.bytes_read(), 16u * 96 * 4 + 700 * 4);
    const uint64_t before = reader.bytes_read();
    const at::Tensor columns = reader.read("model/w", {1, {}, 1, 3});
    EXPECT_TRUE(torch::equal(columns, full.narrow(1, 32, 32)));
    const uint64_t spans = reader.bytes_read() - before;
    EXPECT_GE(spans, 64u * 32 * 4);
    EXPECT_LE(spans, 2u * 64 * 32 * 4);
  }
  // Damage in the data of rank 1's file: opening still works (headers are whole), a read from
  // rank 0's file too; the first read from rank 1's names it.
  const fs::path f = fs::path(dir) / "rank-00001.safetensors";
  {
    std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(static_cast<std::streamoff>(fs::file_size(f) - 5));
    io.put('\x7f');
  }
  const CheckpointReader reader(dir);
  EXPECT_TRUE(torch::equal(reader.read("model/w", {0, {}, 0, 2}), full.narrow(0, 0, 32)));
  const std::string e = error_of([&] { reader.read("model/w", {0, {}, 1, 2}); });
  EXPECT_NE(e.find("rank-00001.safetensors: checksum"), std::string::npos) << e;
  // A split the tensor does not have, and a range outside the shard, are named.
  const std::string split = error_of([&] { reader.read("model/w", {1, {}, 0, 5}); });
  EXPECT_NE(split.find("tensor 'model/w' of shape [64, 96] has no chunk 0 of 5 along dim 1"),
            std::string::npos)
      << split;
  const std::string range = error_of([&] { reader.read("model/w", {0, {}, 0, 2}, 3000, 100); });
  EXPECT_NE(range.find("elements [3000, 3100) are outside its shard of 3072"), std::string::npos)
      << range;
}

// A rank reading its shard of a large file proves what it reads, not the whole file: the
// manifest has, beside the whole file's checksum, one for the header and one for each 4 MiB
// block of data. Opening proves the headers; a read, the blocks it lies in, each once. Damage in
// a block a rank does not read costs it nothing; its first read from a damaged block names the
// file and the block's bytes. The manifest's entries are the writers' own (finish reads no data
// file), and what summing the written files gives.
TEST(CheckpointReader, VerifiesTheBlocksItReads) {
  const fs::path run = fresh("blocks");
  const std::string tmp = begin_sharded_checkpoint(run.string(), 1);
  // Three tensors of 4 MiB + 4 KiB each, one file: each lies in two blocks or three.
  std::vector<at::Tensor> t;
  std::vector<TensorShard> shards;
  for (int i = 0; i < 3; ++i) {
    t.push_back(torch::randn({1025, 1024}));
    shards.push_back({"model/t" + std::to_string(i), t.back(), 0, {}, 0, 1, {}, 0});
  }
  const std::string sums = write_checkpoint_shards(tmp, 0, shards);
  const std::string dir = finish_sharded_checkpoint(run.string(), 1, "{\"step\": 1}", 1, {sums});
  const fs::path f = fs::path(dir) / "rank-00000.safetensors";
  const uint64_t size = fs::file_size(f), block = 4u << 20;
  uint64_t header = 0;
  {
    std::ifstream in(fs::path(dir) / "manifest.json");
    const nlohmann::json m = nlohmann::json::parse(in);
    const nlohmann::json& e = m["files"]["rank-00000.safetensors"];
    header = e["header_bytes"].get<uint64_t>();
    EXPECT_GT(header, 8u);
    EXPECT_LT(header, 4096u);
    EXPECT_EQ(e["bytes"], size);
    EXPECT_EQ(e["block_bytes"], block);
    EXPECT_EQ(e["blocks"].size(), 1 + (size - header + block - 1) / block);
    EXPECT_EQ(e, nlohmann::json::parse(sums)["rank-00000.safetensors"]);
  }
  {
    const CheckpointReader reader(dir);
    EXPECT_EQ(reader.bytes_verified(), header) << "opening proves the header alone";
    // Rows 0-9 of t0: the first block of data.
    EXPECT_TRUE(torch::equal(reader.read("model/t0", {0, {}, 0, 1}, 0, 10 * 1024),
                             t[0].view({-1}).narrow(0, 0, 10 * 1024)));
    EXPECT_EQ(reader.bytes_verified(), header + block);
    // All of t1 (bytes [4 MiB + 4 KiB, 8 MiB + 8 KiB) of the data): blocks 1 and 2 of it.
    EXPECT_TRUE(torch::equal(reader.read("model/t1"), t[1]));
    EXPECT_EQ(reader.bytes_verified(), header + 3 * block);
    EXPECT_LT(reader.bytes_verified(), size);
  }
  // Damage in the last tensor's last bytes: t0 still reads, t2 is named damaged.
  {
    std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(static_cast<std::streamoff>(size - 5));
    io.put('\x7f');
  }
  const CheckpointReader reader(dir);
  EXPECT_TRUE(torch::equal(reader.read("model/t0"), t[0]));
  const std::string e = error_of([&] { reader.read("model/t2"); });
  const uint64_t last = header + (size - 1 - header) / block * block;
  EXPECT_NE(e.find("rank-00000.safetensors: checksum"), std::string::npos) << e;
  EXPECT_NE(e.find("of bytes [" + std::to_string(last) + ", " + std::to_string(size) + ")"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("damaged"), std::string::npos) << e;
  // load_checkpoint reads every tensor: it stops there too.
  EXPECT_NE(error_of([&] { load_checkpoint(dir); }).find("rank-00000.safetensors: checksum"),
            std::string::npos);
}

// A writer sums its file as it writes it, in the pieces it writes, whose sizes need not be
// multiples of the checksum's 8-byte word nor line up with the 4 MiB blocks: the entry it returns
// equals the one summed from the file read back (finish, given no entry, reads it), and loads.
TEST(Checkpoint, SumsTakenWhileWritingEqualTheFilesReadBack) {
  const fs::path run = fresh("sums_while_writing");
  std::vector<TensorShard> shards;
  const std::vector<at::Tensor> t = {
      torch::randn({3}).to(torch::kBFloat16),                    // 6 bytes
      torch::randn({1025 * 1024 + 3}),                           // 4 MiB + 4 KiB + 12 bytes
      torch::randint(0, 255, {5}, torch::kUInt8),                // 5 bytes
      torch::randn({2 * 1024 * 1024 + 7}).to(torch::kBFloat16),  // two 4 MiB pieces, and more
      torch::randn({11}).to(torch::kBFloat16)};
  for (size_t i = 0; i < t.size(); ++i)
    shards.push_back({"model/t" + std::to_string(i), t[i], 0, {}, 0, 1, {}, 0});
  auto entry = [](const std::string& dir) {
    std::ifstream in(fs::path(dir) / "manifest.json");
    return nlohmann::json::parse(in)["files"]["rank-00000.safetensors"];
  };
  const std::string written =
      write_checkpoint_shards(begin_sharded_checkpoint(run.string(), 1), 0, shards);
  const std::string with_sums =
      finish_sharded_checkpoint(run.string(), 1, "{\"step\": 1}", 2, {written});
  write_checkpoint_shards(begin_sharded_checkpoint(run.string(), 2), 0, shards);
  const std::string read_back = finish_sharded_checkpoint(run.string(), 2, "{\"step\": 2}", 2);
  EXPECT_EQ(nlohmann::json::parse(written)["rank-00000.safetensors"], entry(read_back));
  EXPECT_EQ(entry(with_sums), entry(read_back));
  EXPECT_EQ(entry(with_sums)["blocks"].size(), 4u);  // the header and three blocks of data
  const CheckpointReader reader(with_sums);
  for (size_t i = 0; i < t.size(); ++i)
    EXPECT_TRUE(torch::equal(reader.read("model/t" + std::to_string(i)), t[i])) << i;
  EXPECT_EQ(reader.bytes_verified(), reader.file_bytes());
}

// A manifest from before block checksums (a size and one checksum per file) still proves the
// files: each whole, when the checkpoint is opened, and a flipped byte is named.
TEST(CheckpointReader, ManifestWithoutBlocksVerifiesWholeFiles) {
  const fs::path run = fresh("no_blocks");
  const std::string dir = save_checkpoint(run.string(), 1, sample(2.0f), 2);
  const fs::path manifest = fs::path(dir) / "manifest.json";
  nlohmann::json m;
  {
    std::ifstream in(manifest);
    m = nlohmann::json::parse(in);
  }
  for (auto& [name, e] : m["files"].items()) {
    ASSERT_TRUE(e.contains("blocks")) << name;
    e = {{"bytes", e["bytes"]}, {"checksum", e["checksum"]}};
  }
  std::ofstream(manifest, std::ios::trunc) << m.dump();
  const fs::path f = fs::path(dir) / "model.safetensors";
  {
    const CheckpointReader reader(dir);
    EXPECT_EQ(reader.bytes_verified(),
              fs::file_size(f) + fs::file_size(fs::path(dir) / "optimizer.safetensors"))
        << "opening proves each file whole";
    EXPECT_TRUE(torch::equal(reader.read("model/w"), torch::full({64, 64}, 2.0f)));
  }
  {
    std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(static_cast<std::streamoff>(fs::file_size(f) - 3));
    io.put('\x7f');
  }
  const std::string e = error_of([&] { CheckpointReader reader(dir); });
  EXPECT_NE(e.find("model.safetensors: checksum"), std::string::npos) << e;
}

// A writer's entry that no longer fits its file (the file written again after it was summed) is
// refused at finish, naming the file.
TEST(Checkpoint, StaleWriterSumsAreRefused) {
  const fs::path run = fresh("stale_sums");
  const std::string tmp = begin_sharded_checkpoint(run.string(), 1);
  const std::string sums =
      write_checkpoint_shards(tmp, 0, {{"model/w", torch::zeros({4, 3}), 0, {}, 0, 1, {}, 0}});
  write_checkpoint_shards(tmp, 0, {{"model/w", torch::zeros({8, 3}), 0, {}, 0, 1, {}, 0}});
  const std::string e =
      error_of([&] { finish_sharded_checkpoint(run.string(), 1, "{\"step\": 1}", 1, {sums}); });
  EXPECT_NE(e.find("rank-00000.safetensors: "), std::string::npos) << e;
  EXPECT_NE(e.find("but its writer summed"), std::string::npos) << e;
}

// Damage that leaves a file's header readable but changes its shard layout (here rank 1's file
// claims chunk 0): the tensors no longer tile, and the error names the damaged file, not the
// symptom.
TEST(CheckpointReader, DamagedLayoutIsNamedAsDamage) {
  const fs::path run = fresh("damaged_layout");
  const std::string tmp = begin_sharded_checkpoint(run.string(), 1);
  for (int64_t r = 0; r < 2; ++r)
    write_checkpoint_shards(tmp, static_cast<int>(r),
                            {{"model/w", torch::full({2, 3}, 1.0f * r), 0, {}, r, 2, {}, 0}});
  const std::string dir = finish_sharded_checkpoint(run.string(), 1, "{\"step\": 1}", 1);
  const fs::path f = fs::path(dir) / "rank-00001.safetensors";
  std::string bytes;
  {
    std::ifstream in(f, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const size_t pos = bytes.find("\\\"rank\\\":1");
  ASSERT_NE(pos, std::string::npos);
  bytes[pos + std::string("\\\"rank\\\":").size()] = '0';
  std::ofstream(f, std::ios::binary | std::ios::trunc) << bytes;
  const std::string e = error_of([&] { CheckpointReader r(dir); });
  EXPECT_NE(e.find("rank-00001.safetensors: checksum"), std::string::npos) << e;
}

}  // namespace
}  // namespace weft::io
