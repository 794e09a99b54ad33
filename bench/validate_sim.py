#!/usr/bin/python3
"""The simulator against real runs: measured cost profile -> simulated step vs measured step.

    /usr/bin/python3 bench/validate_sim.py [--build build] [--steps 40] [--rounds 2]
                                           [--config configs/tiny-vlm.toml] [--moe] [--write]

1. `weft bench profile CONFIG --set train.threads=1` measures every layer of the config on one
   core, the data preparation and the local Gloo transport — right before and right after each
   real run, since this shared machine's speed drifts by tens of percent over minutes; the
   simulated step is the mean of the two profiles' predictions.
2. A cluster file for this machine is written from the profile's transport measurements (2
   devices of one core each; the device numbers are unused once costs are measured).
3. Each plan runs for real on 2 local ranks, one intra-op thread each
   (`weft launch --nproc 2 -- weft train ... --set train.threads=1`): DP2, LLM TP2, LLM TP2 with
   sequence parallelism (and the encoder's too), LLM PP2 (4 microbatches, 1F1B), the same with a
   4-block LLM in plain and interleaved 1F1B (vp 2) and recomputing every LLM block or the
   first two of stage 0 only (recompute_blocks = [2, 0]; their speed-ups over plain 1F1B are
   printed measured and simulated), LLM CP2, and encoder | LLM on separate ranks; the measured
   step is the median `step_seconds` of metrics.jsonl after the first fifth of the steps (rank 0's
   wall time of the whole step: batch preparation, forward, backward, gradient sync,
   optimizer). Rounds repeat every run; the table takes the median over rounds.
4. `weft simulate CONFIG --profile PROFILE --cluster CLUSTER` predicts each plan's step.

--moe checks expert parallelism instead, on configs/tiny-vlm-moe.toml (its own RESULTS.md
section): the experts replicated over DP2, split over the 2 ranks (EP2, all-to-all dispatch), and
whole experts under LLM TP2 with EP2 across the TP ranks.

Prints plan, measured, simulated, simulated/measured and the FLOP model's prediction (no
profile: configs/clusters/cpu-local.toml's measured peak and efficiency) for comparison. The machine is
shared: before every timed run the script waits until no compiler (cc1plus) runs, and reports
whether it had to wait or gave up waiting. --write replaces this script's section of
bench/RESULTS.md.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import results_md  # bench/RESULTS.md sections

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- bench/validate_sim begin -->", "<!-- bench/validate_sim end -->"

PLANS = [
    ("DP2", []),
    ("TP2 (LLM)", ["parallel.llm.tp=2"]),
    ("TP2 + SP (LLM)", ["parallel.llm.tp=2", "parallel.llm.sp=true"]),
    ("TP2 + SP (vision and LLM)", ["parallel.llm.tp=2", "parallel.llm.sp=true",
                                   "parallel.vision.tp=2", "parallel.vision.sp=true"]),
    ("PP2 (LLM, 4 microbatches)", ["parallel.llm.pp=2", "train.microbatches=4"]),
    ("PP2 (4-block LLM, 4 microbatches)",
     ["parallel.llm.pp=2", "train.microbatches=4", "model.llm.layers=4"]),
    ("PP2 vp2 interleaved (4-block LLM, 4 microbatches)",
     ["parallel.llm.pp=2", "parallel.llm.vp=2", "train.microbatches=4", "model.llm.layers=4"]),
    ("PP2, every LLM block recomputed (4-block LLM, 4 microbatches)",
     ["parallel.llm.pp=2", "train.microbatches=4", "model.llm.layers=4",
      "model.llm.recompute=true"]),
    ("PP2, recompute_blocks = [2, 0] (4-block LLM, 4 microbatches)",
     ["parallel.llm.pp=2", "train.microbatches=4", "model.llm.layers=4",
      "model.llm.recompute=true", "model.llm.recompute_blocks=[2,0]"]),
    ("CP2 (LLM)", ["parallel.llm.cp=2"]),
    ("encoder, LLM on separate ranks", ["parallel.placement=separate"]),
]
# (baseline, plan): the plan's speed-up over the baseline, measured and simulated in each round.
SPEEDUPS = [("PP2 (4-block LLM, 4 microbatches)",
             "PP2 vp2 interleaved (4-block LLM, 4 microbatches)"),
            ("PP2 (4-block LLM, 4 microbatches)",
             "PP2, every LLM block recomputed (4-block LLM, 4 microbatches)"),
            ("PP2 (4-block LLM, 4 microbatches)",
             "PP2, recompute_blocks = [2, 0] (4-block LLM, 4 microbatches)")]
MOE_PLANS = [
    ("DP2, experts replicated", []),
    ("EP2 (experts over the 2 DP ranks)", ["parallel.llm.ep=2"]),
    ("TP2 (LLM), whole experts, EP2 across the TP ranks",
     ["parallel.llm.tp=2", "parallel.llm.etp=1", "parallel.llm.ep=2"]),
]
MOE_BEGIN, MOE_END = "<!-- bench/validate_sim_moe begin -->", "<!-- bench/validate_sim_moe end -->"


def busy_compilers():
    out = subprocess.run(["pgrep", "-c", "cc1plus"], capture_output=True, text=True)
    return int(out.stdout.strip() or 0)


def cpu_jiffies():
    """(busy, total) jiffies of the whole machine; steal counts as busy (a noisy neighbour)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (v + [0] * 8)[:8]
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


class Quiet:
    """Timing on a shared machine: before a timed command, waits until no compiler runs and the
    CPUs are idle; during it, measures the CPU time other processes took (the machine's busy
    time minus this script's and its children's) and calls the run noisy when that exceeds a
    tenth of one core on average. A noisy run is repeated (up to `tries` times)."""

    HZ = os.sysconf("SC_CLK_TCK")

    def __init__(self, max_wait, tries=4):
        self.max_wait, self.tries = max_wait, tries
        self.waited, self.runs, self.repeated, self.noisy = 0.0, 0, 0, 0

    def wait(self):
        t0 = time.time()
        while time.time() - t0 < self.max_wait:
            if busy_compilers() == 0:
                b0, t0j = cpu_jiffies()
                time.sleep(2)
                b1, t1j = cpu_jiffies()
                if (b1 - b0) <= 0.15 * (t1j - t0j):
                    break
            else:
                time.sleep(5)
        self.waited += time.time() - t0

    def timed(self, fn):
        """fn() run on a quiet machine; retried while other processes disturbed it."""
        for attempt in range(self.tries):
            self.wait()
            own0, (b0, _), w0 = self._own(), cpu_jiffies(), time.time()
            result = fn()
            own1, (b1, _), w1 = self._own(), cpu_jiffies(), time.time()
            foreign = (b1 - b0) / self.HZ - (own1 - own0)
            self.runs += 1
            if foreign <= 0.1 * (w1 - w0) and busy_compilers() == 0:
                return result
            self.repeated += 1
        self.noisy += 1
        return result

    @staticmethod
    def _own():
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def describe(self):
        state = (f"{self.runs} timed runs, {self.repeated} repeated because other processes "
                 f"used the CPU during them, {self.waited:.0f} s spent waiting for quiet")
        if self.noisy:
            return f"NOT quiet: {self.noisy} measurement(s) stayed disturbed ({state})"
        return f"quiet ({state})"


def run(cmd, what):
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"validate_sim.py: {what} failed: {' '.join(cmd)}\n{out.stdout[-2000:]}"
                 f"{out.stderr[-3000:]}")
    return out.stdout


def sets(values):
    args = []
    for v in values:
        args += ["--set", v]
    return args


def measure(args, tmp, name, extra, quiet):
    """Median step seconds of a real 2-rank run."""
    common = [f"train.steps={args.steps}", "train.warmup=5", "train.threads=1",
              "train.checkpoint_every=0", "data.eval_samples=16", "output.trace_step=0"]
    weft = os.path.join(args.build, "weft")

    def once():
        # A fresh run directory each time (a repeated run may not write over the last).
        out = os.path.join(tmp, name.split()[0] + "-" + str(time.time_ns()))
        run([weft, "launch", "--nproc", "2", "--", weft, "train", args.config,
             *sets(common + extra), "--out", out, "--quiet"], f"{name} run")
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        rows = rows[len(rows) // 5:]
        return statistics.median(r["step_seconds"] for r in rows)

    return quiet.timed(once)


def profile_pair(args, tmp, weft, quiet):
    """Profiles the config now; returns the file and a function that profiles it again (after
    the run it brackets)."""
    def take(path):
        quiet.timed(lambda: run([weft, "bench", "profile", args.config, "--set",
                                 "train.threads=1", "--reps", str(args.reps), "--out", path],
                                "profile"))
        return path
    before = take(os.path.join(tmp, "before.json"))
    return before, lambda: take(os.path.join(tmp, "after.json"))


def simulate(args, extra, profile=None, cluster=None, flags=()):
    cmd = [os.path.join(args.build, "weft"), "simulate", args.config, "--world-size", "2",
           "--cluster", cluster or os.path.join(ROOT, "configs", "clusters", "cpu-local.toml"),
           *sets(["train.threads=1"] + extra), *flags]
    if profile:
        cmd += ["--profile", profile]
    return json.loads(run(cmd, "simulate"))


def write_cluster(profile, path):
    p = json.load(open(profile))
    link = p["comm"]["all_reduce"]
    with open(path, "w") as f:
        f.write("# This machine, measured by `weft bench profile` (Gloo over loopback TCP, two\n"
                "# ranks): one device per core.\n")
        f.write("nodes = 1\ngpus_per_node = 2\ndevice = \"cpu-core\"\n[intra_node]\n")
        f.write(f"bandwidth_gbs = {link['bandwidth_gbs']:.4g}\n")
        f.write(f"latency_us = {link['latency_us']:.4g}\n")
        shm = p["comm"].get("all_reduce_blocking")
        if p["comm"].get("activation_transport") == "shared memory" and shm:
            # A two-rank all-reduce through shared memory copies 3x its bytes (cluster.h).
            f.write("[shared_memory]\n")
            f.write(f"bandwidth_gbs = {3 * shm['bandwidth_gbs']:.4g}\n")
            f.write(f"latency_us = {shm['latency_us']:.4g}\n")
    return p


def media_text(prof):
    """The profile's per-encoder media decoding cost, as text (older profiles have none)."""
    media = prof["data"].get("media_seconds_per_sample", {})
    return "".join(f", {name} media {1e3 * v:.3f} ms" for name, v in media.items())


def message_transport(comm):
    """What carried the profile's point-to-point messages (older profiles: Gloo)."""
    return ("through shared memory" if comm.get("message_transport") == "shared memory"
            else "over Gloo")


def blocking_text(comm):
    """The blocking collectives' transport, where the profile says (older profiles do not)."""
    if comm.get("activation_transport") != "shared memory":
        return ""
    b, a = comm["all_reduce_blocking"], comm["all_reduce_compute"]
    return (f"; blocking collectives through shared memory: fp32 all-reduce {b['latency_us']:.0f} "
            f"us per hop + {b['bandwidth_gbs']:.2f} GB/s, in the compute dtype "
            f"{a['latency_us']:.0f} us + {a['bandwidth_gbs']:.2f} GB/s")


def machine():
    return results_md.machine()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--config", default=None, help="default configs/tiny-vlm.toml "
                    "(configs/tiny-vlm-moe.toml with --moe)")
    ap.add_argument("--moe", action="store_true", help="expert-parallel plans of an MoE config")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7, help="profile repetitions per measurement")
    ap.add_argument("--max-wait", type=float, default=900, help="seconds to wait for quiet")
    ap.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()
    plans = MOE_PLANS if args.moe else PLANS
    begin, end = (MOE_BEGIN, MOE_END) if args.moe else (BEGIN, END)
    if args.config is None:
        args.config = "configs/tiny-vlm-moe.toml" if args.moe else "configs/tiny-vlm.toml"
    args.build = args.build if os.path.isabs(args.build) else os.path.join(ROOT, args.build)
    quiet = Quiet(args.max_wait)
    weft = os.path.join(args.build, "weft")
    runs = {name: [] for name, _ in plans}  # per round: (measured, simulated)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, extra in plans:
                # The machine's speed drifts by tens of percent over minutes: every run is
                # bracketed by two profiles, and simulated with each (the mean is reported).
                before, after = profile_pair(args, tmp, weft, quiet)
                got = measure(args, tmp, name, extra, quiet)
                sims = []
                for profile in (before, after(),):
                    cluster = profile + ".cluster.toml"
                    prof = write_cluster(profile, cluster)
                    sims.append(simulate(args, extra, profile, cluster)["step_seconds"])
                sim = statistics.mean(sims)
                runs[name].append((got, sim))
                print(f"round {r + 1}: {name}: measured {got:.4f} s, simulated {sim:.4f} s",
                      flush=True)
        rows = []
        for name, extra in plans:
            got = statistics.median(g for g, _ in runs[name])
            sim = statistics.median(x for _, x in runs[name])
            ratio = statistics.median(x / g for g, x in runs[name])
            flop = simulate(args, extra)["step_seconds"]
            rows.append((name, got, sim, ratio, flop, runs[name]))

    comm = prof["comm"]
    title = ("Simulator vs real runs, expert parallelism (bench/validate_sim.py --moe)" if args.moe
             else "Simulator vs real runs (bench/validate_sim.py)")
    lines = [begin, f"## {title}", "",
             f"Machine: {machine()}. Reproduce: `/usr/bin/python3 bench/validate_sim.py"
             f"{' --moe' if args.moe else ''} --write`. "
             f"Config `{args.config}`, 2 local ranks with one intra-op thread each, "
             f"{args.steps} steps per run, median step time after the first fifth, median over "
             f"{args.rounds} rounds. Machine state: {quiet.describe()}.", "",
             f"Profile (`weft bench profile --set train.threads=1 --reps {args.reps}`): "
             f"{prof['device']}; data preparation {1e3 * prof['data']['seconds_per_sample']:.3f} "
             f"ms per sample{media_text(prof)}; Gloo two-rank all-reduce {comm['all_reduce']['latency_us']:.0f} us "
             f"per hop + {comm['all_reduce']['bandwidth_gbs']:.2f} GB/s; point-to-point "
             f"{message_transport(comm)} {comm['p2p']['latency_us']:.0f} us + "
             f"{comm['p2p']['bandwidth_gbs']:.2f} GB/s"
             f"{blocking_text(comm)}.", "",
             "| plan | measured s | simulated s (profile) | simulated / measured | "
             "FLOP model s (cpu-local.toml) | per round: measured / simulated |",
             "|---|---|---|---|---|---|"]
    within = 0
    for name, got, sim, ratio, flop, per_round in rows:
        within += abs(ratio - 1) <= 0.2
        lines.append(f"| {name} | {got:.4f} | {sim:.4f} | {ratio:.2f} | {flop:.4f} | "
                     + ", ".join(f"{g:.4f} / {x:.4f}" for g, x in per_round) + " |")
    lines += ["", f"{within} of {len(rows)} plans simulated within 20% of the measured step "
              "(the ratio is the median over rounds of the simulated / measured ratio of the same "
              "round). The last profile taken is described above; each simulated value is the "
              "mean of the predictions from the profiles taken right before and right after its "
              "run."]
    for base, plan in ([] if args.moe else SPEEDUPS):
        pairs = list(zip(runs[base], runs[plan]))
        got = statistics.median(b[0] / x[0] for b, x in pairs)
        sim = statistics.median(b[1] / x[1] for b, x in pairs)
        lines += ["", f"{plan} vs {base}: speed-up measured {got:.3f}x, simulated {sim:.3f}x "
                  "(median over rounds of the ratio within a round; per round measured / "
                  "simulated: " + ", ".join(f"{b[0] / x[0]:.3f}x / {b[1] / x[1]:.3f}x"
                                             for b, x in pairs) + ")."]
    lines += ["", end]
    print("\n".join(lines[1:-1]))
    if args.write:
        results_md.write_section(lines, begin, end)


if __name__ == "__main__":
    main()
