#!/usr/bin/python3
"""Pipeline partition benchmark: weft's stage boundaries against an even layer split, measured
and simulated, on a frozen-encoder VLM.

    /usr/bin/python3 bench/pp_partition.py [--build build] [--steps 40] [--rounds 2] [--write]

configs/pp-vlm.toml: tiny-vlm's frozen vision encoder (data-parallel over both ranks) in front
of an 8-layer LLM with a 16k vocabulary, LLM pp = 2, 4 microbatches (1F1B), 2 local ranks with
one intra-op thread each. Its output head and loss over 16k logits cost several blocks, so an
even split [4] leaves the last stage the bottleneck. Compared, all in one invocation:
  even          parallel.llm.stages = [layers / 2]
  weft (FLOP)   `weft plan`'s default, what `weft train` picks without a profile: the joint
                partition on the FLOP model of the data's mean sample (its padded rows, the
                output head on its loss targets only, as weft's loss computes logits)
  weft (FLOP, full rows)  the same on full max_seq rows with a loss on every position
                (`weft plan --full-rows`)
  weft (profile) the joint partition on the measured profile (`weft simulate --profile`)
Each split runs for real (`weft launch --nproc 2 -- weft train ... --set parallel.llm.stages=[k]`,
median step_seconds after the first fifth of the steps, median over rounds) and is simulated
with the round's profile and a cluster file of its measured transport. Prints the step times and
the speed-up of each split over the even one, measured and simulated. Timed runs wait for a
quiet machine and repeat when other processes used the CPU during them (bench/validate_sim.py).
--write replaces this script's section of bench/RESULTS.md.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import validate_sim as vs  # noqa: E402  (shared: quiet machine, runs, cluster file)
import results_md  # noqa: E402  (bench/RESULTS.md sections)

ROOT = vs.ROOT
BEGIN, END = "<!-- bench/pp_partition begin -->", "<!-- bench/pp_partition end -->"
CONFIG = "configs/pp-vlm.toml"


def simulate(args, extra, profile, cluster):
    return vs.simulate(args, extra, profile, cluster)


def measure(args, tmp, name, extra, quiet):
    common = [f"train.steps={args.steps}", "train.warmup=5", "train.threads=1",
              "data.eval_samples=16", "output.trace_step=0"]
    weft = os.path.join(args.build, "weft")

    def once():
        # A fresh run directory each time (a repeated run may not write over the last).
        out = os.path.join(tmp, f"{name}-{time.time_ns()}")
        vs.run([weft, "launch", "--nproc", "2", "--", weft, "train", args.config,
                *vs.sets(common + extra), "--out", out, "--quiet"], f"{name} run")
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        rows = rows[len(rows) // 5:]
        return statistics.median(r["step_seconds"] for r in rows)

    return quiet.timed(once)


def stages_set(b):
    return f"parallel.llm.stages=[{', '.join(str(x) for x in b)}]"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5, help="profile repetitions per measurement")
    ap.add_argument("--max-wait", type=float, default=900, help="seconds to wait for quiet")
    ap.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()
    args.build = args.build if os.path.isabs(args.build) else os.path.join(ROOT, args.build)
    args.config = args.config if os.path.isabs(args.config) else os.path.join(ROOT, args.config)
    weft = os.path.join(args.build, "weft")
    quiet = vs.Quiet(args.max_wait)
    layers = None
    results = {}  # split name -> list of (boundaries, measured, simulated)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            profile = os.path.join(tmp, f"profile{r}.json")
            cluster = os.path.join(tmp, f"cluster{r}.toml")
            quiet.timed(lambda: vs.run([weft, "bench", "profile", args.config, "--set",
                                        "train.threads=1", "--reps", str(args.reps), "--out",
                                        profile], "profile"))
            prof = vs.write_cluster(profile, cluster)
            plan = json.loads(vs.run([weft, "plan", args.config, "--world-size", "2"], "plan"))
            llm = next(m for m in plan["modules"] if m["name"] == "llm")
            layers = llm["layers"]
            flop = llm["stage_boundaries"]
            full = json.loads(vs.run([weft, "plan", args.config, "--world-size", "2",
                                      "--full-rows"], "plan"))
            full = next(m for m in full["modules"] if m["name"] == "llm")["stage_boundaries"]
            measured_plan = simulate(args, [], profile, cluster)
            splits = [("even", [layers // 2]), ("weft (FLOP model)", flop),
                      ("weft (FLOP model, full rows)", full),
                      ("weft (profile)", measured_plan["stage_boundaries"]["llm"])]
            for name, b in splits:
                extra = [stages_set(b)]
                got = measure(args, tmp, name.split()[0], extra, quiet)
                sim = simulate(args, extra, profile, cluster)["step_seconds"]
                results.setdefault(name, []).append((b, got, sim))
                print(f"round {r + 1}: {name} {b}: measured {got:.4f} s, simulated {sim:.4f} s",
                      flush=True)
    even = results["even"]
    lines = [BEGIN, "## Pipeline partition: weft vs an even split (bench/pp_partition.py)", "",
             f"Machine: {vs.machine()}. Reproduce: `/usr/bin/python3 bench/pp_partition.py "
             f"--write`. `{os.path.relpath(args.config, ROOT)}`: frozen ViT (data-parallel on "
             f"both ranks) + {layers}-layer LLM, vocab 16k, LLM pp = 2, 4 microbatches, 2 local "
             f"ranks with one thread each; {args.steps} steps per run, median step after the "
             f"first fifth, median over {args.rounds} rounds. Machine state: "
             f"{quiet.describe()}. Profile: {prof['device']}.", "",
             "| split | LLM stage boundaries | measured s | simulated s | measured speed-up vs "
             "even | simulated speed-up vs even | per round: measured / simulated |",
             "|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        got = statistics.median(g for _, g, _ in runs)
        sim = statistics.median(s for _, _, s in runs)
        # Speed-ups of the same round, then the median over rounds.
        m_up = statistics.median(e[1] / g for e, (_, g, _) in zip(even, runs))
        s_up = statistics.median(e[2] / s for e, (_, _, s) in zip(even, runs))
        bounds = ", ".join(str(list(b)) for b in sorted({tuple(b) for b, _, _ in runs}))
        per_round = ", ".join(f"{g:.4f} / {x:.4f}" for _, g, x in runs)
        lines.append(f"| {name} | {bounds} | {got:.4f} | {sim:.4f} | {m_up:.3f}x | {s_up:.3f}x | "
                     f"{per_round} |")
    lines += ["", "Speed-up = the even split's step time / this split's, in the same round.",
              "", END]
    print("\n".join(lines[1:-1]))
    if args.write:
        results_md.write_section(lines, BEGIN, END)


if __name__ == "__main__":
    main()
