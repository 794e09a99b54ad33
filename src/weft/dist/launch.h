// `weft launch`: starts N local ranks of a command with RANK / WORLD_SIZE / LOCAL_RANK /
// LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, prefixes every output line with its rank, and
// propagates failure: when a rank exits non-zero or is killed, the others get SIGTERM, then SIGKILL
// after the grace period, and launch returns non-zero naming the rank. Ranks die with the launcher
// (PR_SET_PDEATHSIG), so no orphan is left behind. With max_restarts = K, a failed job is
// started again, up to K times, with WEFT_RESTART=<attempt> in every rank's environment
// (`weft train --out DIR` then resumes from DIR's last complete checkpoint). Not thread-safe;
// call from main().
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace weft::dist {

// A rank's exit status for bad input found before training (config, layout, --out): the same
// input would fail again, so `weft launch --max-restarts` does not restart it.
constexpr int kInputErrorExit = 3;

struct LaunchOptions {
  int nproc = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0 = a free port chosen by the launcher
  double grace_seconds = 10;
  int max_restarts = 0;
  std::vector<std::string> command;  // argv of every rank
};

// Runs the job to completion; returns the launcher's exit status (0 when every rank succeeded).
int launch(const LaunchOptions& opts);

// A TCP port on the loopback interface that was free a moment ago.
int free_port();

// The intra-op threads a process uses: `requested` when > 0; else the cores it may run on (its
// CPU affinity) shared among the ranks started on this machine (LOCAL_WORLD_SIZE, as `weft
// launch` and torchrun set it), at least 1. Ranks of all-core thread pools on shared cores spin
// against each other: tiny-vlm's DP2 steps ran 5.7-7.5x slower that way on 2 cores.
int intra_op_threads(int64_t requested);

}  // namespace weft::dist
