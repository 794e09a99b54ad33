#!/usr/bin/python3
"""The layout search priced by a measured profile against the FLOP model's, on real runs.

    /usr/bin/python3 bench/validate_search.py [--build build] [--config CONFIG ...] [--top 3]
                                              [--steps 40] [--rounds 2] [--write]

For each config (default configs/tiny-vlm.toml, configs/tiny-valm.toml and configs/pp-vlm.toml):
1. `weft bench profile CONFIG --set train.threads=1` measures every layer on one core, the data
   preparation and the local Gloo transport.
2. `weft plan CONFIG --cluster configs/clusters/cpu-local.toml --top N` searches the 2-rank
   layouts, microbatches, ZeRO-1 and recomputation three times: on the FLOP model (the cluster
   file's measured peak, efficiency and block overhead) of the data's mean sample, the default;
   on the FLOP model of full max_seq rows (`--full-rows`); and with `--profile` (every bound and
   simulation on the measured costs).
3. Every plan of any table (the union of the top N) is simulated under each model and runs
   for real on 2 local ranks, one intra-op thread each (`weft launch --nproc 2`); the measured
   step is the median `step_seconds` after the first fifth, the median over rounds (each round
   runs every plan once, in a rotated order: the machine drifts over minutes).

Prints per config every plan's rank in each table, its predicted steps and its measured one; the
measured-fastest plan's place in each model's order; and each model's rank agreement with the
measurements (Kendall's tau over the plans: 1 = the same order). Waits for a quiet machine
before every timed run as validate_sim.py does. --write replaces this script's section of
bench/RESULTS.md.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

import results_md  # bench/RESULTS.md sections
from validate_sim import ROOT, Quiet, measure, run, simulate

BEGIN, END = "<!-- bench/validate_search begin -->", "<!-- bench/validate_search end -->"
CLUSTER = os.path.join(ROOT, "configs", "clusters", "cpu-local.toml")
CONFIGS = ["configs/tiny-vlm.toml", "configs/tiny-valm.toml", "configs/pp-vlm.toml"]


MODELS = ("FLOP model", "full rows", "profile")


def search(args, config, profile=None, flags=()):
    """The table of `weft plan --cluster` (2 ranks): its rows, fastest first."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [os.path.join(args.build, "weft"), "plan", config, "--cluster", CLUSTER,
               "--top", str(args.top), "--set", "train.threads=1", "--json", out.name, *flags]
        if profile:
            cmd += ["--profile", profile]
        run(cmd, "plan")
        return json.load(open(out.name))["best"]


def kendall_tau(xs, ys):
    """Kendall's tau-a of two orderings of the same items (values: lower = faster)."""
    n, s = len(xs), 0
    for i in range(n):
        for j in range(i + 1, n):
            a, b = xs[i] - xs[j], ys[i] - ys[j]
            s += (a * b > 0) - (a * b < 0)
    return s / (n * (n - 1) / 2) if n > 1 else 1.0


def place(values, i):
    """1-based place of item i when ordered by values (fastest first)."""
    return sorted(range(len(values)), key=lambda k: values[k]).index(i) + 1


def cell(text):
    return text.replace("|", "\\|")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--config", action="append", default=None,
                    help="repeatable; default " + ", ".join(CONFIGS))
    ap.add_argument("--top", type=int, default=3, help="plans taken from each search's table")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7, help="profile repetitions")
    ap.add_argument("--max-wait", type=float, default=900, help="seconds to wait for quiet")
    ap.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()
    configs = args.config or CONFIGS
    args.build = args.build if os.path.isabs(args.build) else os.path.join(ROOT, args.build)
    weft = os.path.join(args.build, "weft")
    quiet = Quiet(args.max_wait)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in configs:
            args.config = config  # validate_sim.measure and simulate use args.config
            profile = os.path.join(tmp, os.path.basename(config) + ".profile.json")
            quiet.timed(lambda: run([weft, "bench", "profile", config, "--set", "train.threads=1",
                                     "--reps", str(args.reps), "--out", profile], "profile"))
            device = json.load(open(profile))["device"]
            tables = {"FLOP model": search(args, config),
                      "full rows": search(args, config, flags=["--full-rows"]),
                      "profile": search(args, config, profile)}
            plans = []  # {layout, overrides, world, ranks: {model: place in its table}}
            for model, rows in tables.items():
                for i, row in enumerate(rows):
                    same = [p for p in plans if p["overrides"] == row["overrides"]]
                    if not same:
                        plans.append({"layout": row["layout"], "overrides": row["overrides"],
                                      "world": row["world_size"], "ranks": {}})
                        same = plans[-1:]
                    same[0]["ranks"][model] = i + 1
            for p in plans:
                if p["world"] != 2:
                    sys.exit(f"validate_search.py: {config}: {p['layout']} uses {p['world']} "
                             "ranks; the real runs use 2")
                # validate_sim.simulate: args.config on 2 ranks of cpu-local.toml
                p["flop"] = simulate(args, p["overrides"])["step_seconds"]
                p["full"] = simulate(args, p["overrides"], flags=["--full-rows"])["step_seconds"]
                p["predicted"] = simulate(args, p["overrides"], profile, CLUSTER)["step_seconds"]
                p["measured"] = []
            for r in range(args.rounds):
                for k in range(len(plans)):
                    p = plans[(k + r) % len(plans)]
                    got = measure(args, tmp, f"plan{plans.index(p)}", p["overrides"], quiet)
                    p["measured"].append(got)
                    print(f"round {r + 1}: {config}: {p['layout']}: measured {got:.4f} s, "
                          f"profile {p['predicted']:.4f} s, FLOP model {p['flop']:.4f} s "
                          f"(full rows {p['full']:.4f} s)",
                          flush=True)
            for p in plans:
                p["median"] = statistics.median(p["measured"])
            results.append((config, device, plans))

    lines = [BEGIN, "## Layout search on a measured profile vs on the FLOP model "
             "(bench/validate_search.py)", "",
             f"Machine: {results_md.machine()}. Reproduce: `/usr/bin/python3 "
             f"bench/validate_search.py --write`. Each config is searched with `weft plan CONFIG "
             f"--cluster configs/clusters/cpu-local.toml --top {args.top} --set train.threads=1` "
             f"(2 ranks) three times: on the FLOP model of the data's mean sample (the default), "
             f"on the FLOP model of full max_seq rows (`--full-rows`), and with `--profile` "
             f"(`weft bench profile --set train.threads=1 --reps {args.reps}`); every plan of any "
             f"table then trains for "
             f"real on 2 local ranks, one intra-op thread each, {args.steps} steps, once per "
             f"round in a rotated order, {args.rounds} rounds; measured = the median over rounds "
             f"of the median step after the first fifth. Machine state: {quiet.describe()}.", ""]
    for config, device, plans in results:
        measured = [p["median"] for p in plans]
        flop = [p["flop"] for p in plans]
        full = [p["full"] for p in plans]
        predicted = [p["predicted"] for p in plans]
        fastest = min(range(len(plans)), key=lambda k: measured[k])
        lines += [f"`{config}` (profile: {device}):", "",
                  "| plan | FLOP model: rank, s | full rows: rank, s | profile: rank, s | "
                  "measured s | FLOP model / measured | full rows / measured | "
                  "profile / measured | per round |", "|---|---|---|---|---|---|---|---|---|"]
        for p in plans:
            rank = {m: (f"#{p['ranks'][m]}" if m in p["ranks"] else "-") for m in MODELS}
            lines.append(f"| {cell(p['layout'])} | {rank['FLOP model']}, {p['flop']:.4f} | "
                         f"{rank['full rows']}, {p['full']:.4f} | "
                         f"{rank['profile']}, {p['predicted']:.4f} | {p['median']:.4f} | "
                         f"{p['flop'] / p['median']:.2f} | {p['full'] / p['median']:.2f} | "
                         f"{p['predicted'] / p['median']:.2f} | "
                         + ", ".join(f"{x:.4f}" for x in p["measured"]) + " |")
        lines += ["", f"Measured fastest: {cell(plans[fastest]['layout'])}: the profile's "
                  f"#{place(predicted, fastest)}, the FLOP model's #{place(flop, fastest)} and "
                  f"full rows' #{place(full, fastest)} of these {len(plans)} plans. Rank "
                  f"agreement with the measurements (Kendall's tau): profile "
                  f"{kendall_tau(predicted, measured):.2f}, FLOP model "
                  f"{kendall_tau(flop, measured):.2f}, full rows {kendall_tau(full, measured):.2f}.",
                  ""]
    lines.append(END)
    print("\n".join(lines[1:-1]))
    if args.write:
        results_md.write_section(lines, BEGIN, END)


if __name__ == "__main__":
    main()
