#!/usr/bin/python3
"""The layout search priced by a measured profile against the FLOP model's, on real runs.

    /usr/bin/python3 bench/validate_search.py [--build build] [--config CONFIG ...] [--steps 40]
                                              [--rounds 3] [--write]

For each config (default configs/tiny-vlm.toml and configs/tiny-valm.toml):
1. `weft bench profile CONFIG --set train.threads=1` measures every layer on one core, the data
   preparation and the local Gloo transport.
2. `weft plan CONFIG --cluster configs/clusters/cpu-local.toml` searches the 2-rank layouts,
   microbatches, ZeRO-1 and recomputation twice: on the FLOP model (the cluster file's measured
   peak and efficiency) and with `--profile` (every bound and simulation on the measured costs).
3. Both winners run for real on 2 local ranks, one intra-op thread each (`weft launch --nproc 2`),
   alternating within each round (the machine drifts over minutes: a ratio within a round is
   what counts); the measured step is the median `step_seconds` after the first fifth.

Prints, per config, each search's winner, its predicted step under the FLOP model and under the
profile, its measured step, and the speed-up of the profile's winner over the FLOP model's
(median over rounds of the ratio within a round). Waits for a quiet machine before every timed
run as validate_sim.py does. --write replaces this script's section of bench/RESULTS.md.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import results_md  # bench/RESULTS.md sections
from validate_sim import ROOT, Quiet, measure, run, sets

BEGIN, END = "<!-- bench/validate_search begin -->", "<!-- bench/validate_search end -->"
CLUSTER = os.path.join(ROOT, "configs", "clusters", "cpu-local.toml")


def search(args, config, profile=None):
    """The winner of `weft plan --cluster` (2 ranks): its summary row."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [os.path.join(args.build, "weft"), "plan", config, "--cluster", CLUSTER,
               "--set", "train.threads=1", "--json", out.name]
        if profile:
            cmd += ["--profile", profile]
        run(cmd, "plan")
        j = json.load(open(out.name))
    return j["best"][0]


def simulate(args, config, overrides, world, profile=None):
    cmd = [os.path.join(args.build, "weft"), "simulate", config, "--cluster", CLUSTER,
           "--world-size", str(world), *sets(["train.threads=1"] + overrides)]
    if profile:
        cmd += ["--profile", profile]
    return json.loads(run(cmd, "simulate"))["step_seconds"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--config", action="append", default=None,
                    help="repeatable; default configs/tiny-vlm.toml and configs/tiny-valm.toml")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=7, help="profile repetitions")
    ap.add_argument("--max-wait", type=float, default=900, help="seconds to wait for quiet")
    ap.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()
    configs = args.config or ["configs/tiny-vlm.toml", "configs/tiny-valm.toml"]
    args.build = args.build if os.path.isabs(args.build) else os.path.join(ROOT, args.build)
    weft = os.path.join(args.build, "weft")
    quiet = Quiet(args.max_wait)
    sections = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in configs:
            args.config = config  # validate_sim.measure runs args.config
            profile = os.path.join(tmp, os.path.basename(config) + ".profile.json")
            quiet.timed(lambda: run([weft, "bench", "profile", config, "--set", "train.threads=1",
                                     "--reps", str(args.reps), "--out", profile], "profile"))
            device = json.load(open(profile))["device"]
            winners = {"FLOP model": search(args, config), "profile": search(args, config, profile)}
            for name, w in winners.items():
                w["flop_s"] = simulate(args, config, w["overrides"], w["world_size"])
                w["profile_s"] = simulate(args, config, w["overrides"], w["world_size"], profile)
                print(f"{config}: {name} search: {w['layout']}: FLOP model {w['flop_s']:.4f} s, "
                      f"profile {w['profile_s']:.4f} s", flush=True)
            same = winners["FLOP model"]["overrides"] == winners["profile"]["overrides"]
            measured = {name: [] for name in winners}
            for r in range(args.rounds):
                for name, w in winners.items():
                    if same and name == "profile":
                        measured[name].append(measured["FLOP model"][-1])
                        continue
                    if w["world_size"] != 2:
                        sys.exit(f"validate_search.py: {config}: the {name} winner uses "
                                 f"{w['world_size']} ranks; the real runs use 2")
                    got = measure(args, tmp, name.replace(" ", "-"), w["overrides"], quiet)
                    measured[name].append(got)
                    print(f"round {r + 1}: {config}: {name} winner measured {got:.4f} s",
                          flush=True)
            sections.append((config, device, winners, measured, same))

    lines = [BEGIN, "## Layout search on a measured profile vs the FLOP model "
             "(bench/validate_search.py)", "",
             f"Machine: {results_md.machine()}. Reproduce: `/usr/bin/python3 "
             f"bench/validate_search.py --write`. Each search is `weft plan CONFIG --cluster "
             f"configs/clusters/cpu-local.toml --set train.threads=1` (2 ranks), without and "
             f"with `--profile` (`weft bench profile --set train.threads=1 --reps {args.reps}`); "
             f"both winners then train for real on 2 local ranks, one intra-op thread each, "
             f"{args.steps} steps, alternating within each of {args.rounds} rounds; measured = "
             f"the median step after the first fifth. Machine state: {quiet.describe()}.", ""]
    for config, device, winners, measured, same in sections:
        lines += [f"`{config}` (profile: {device})" + (": both searches pick the same plan."
                                                      if same else ":"), "",
                  "| search | winner | predicted, FLOP model s | predicted, profile s | "
                  "measured s (median) | per round |", "|---|---|---|---|---|---|"]
        for name, w in winners.items():
            m = measured[name]
            lines.append(f"| {name} | {w['layout']} | {w['flop_s']:.4f} | {w['profile_s']:.4f} | "
                         f"{statistics.median(m):.4f} | " + ", ".join(f"{x:.4f}" for x in m) + " |")
        if not same:
            pairs = list(zip(measured["FLOP model"], measured["profile"]))
            got = statistics.median(f / p for f, p in pairs)
            predicted = winners["FLOP model"]["profile_s"] / winners["profile"]["profile_s"]
            lines += ["", f"The profile's winner over the FLOP model's: measured {got:.3f}x "
                      "(median over rounds of the ratio within a round: "
                      + ", ".join(f"{f / p:.3f}x" for f, p in pairs)
                      + f"); the profile predicted {predicted:.3f}x."]
        lines.append("")
    lines.append(END)
    print("\n".join(lines[1:-1]))
    if args.write:
        results_md.write_section(lines, BEGIN, END)


if __name__ == "__main__":
    main()
