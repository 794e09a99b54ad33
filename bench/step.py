#!/usr/bin/python3
"""Training-step benchmark: weft against a PyTorch-eager reference, in one run.

    /usr/bin/python3 bench/step.py [--build build] [--rounds 2] [--steps 3] [--no-sweeps] [--write]

For tiny-vlm and small-vlm (configs/), each round runs, one after another on the same batches:
  weft        `weft bench step CONFIG --dump DIR` (the real Trainer step, timed in-process)
  eager       bench/eager_reference.py DIR               (idiomatic PyTorch: full-logit loss)
  eager-tgt   bench/eager_reference.py DIR --head targets (PyTorch with weft's target-only head)
and reports per-step medians and the ratios eager/weft measured in the same round (the median
over rounds); the runs' losses must agree (bf16: 2e-2 relative) or the benchmark fails. Then:
activation recomputation on vs off (peak memory and step time), parameters cast to bf16 once
per step vs at every use (4 microbatches; identical losses checked), frozen modules held in bf16
vs fp32 (identical losses checked), evaluation's caption generation with and without the KV
cache (`weft bench generate`), and how the step grows with
sequence length and with images per sample (data.kind = "synthetic"), written as a table and an
SVG plot (bench/step_scaling.svg). --write replaces the "Training step" section of
bench/RESULTS.md with the result.

Memory is the process's peak resident set during the timed steps minus its resident set before
the model was built (the same definition on both sides; Linux /proc/self/status). Beside weft's,
the planner's prediction of the same step (`weft simulate --world-size 1`, the FLOP model's
memory: parameters, their casts, gradients, moments, activations in flight).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import results_md  # bench/RESULTS.md sections

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = "/usr/bin/python3"
BEGIN, END = "<!-- bench/step.py begin -->", "<!-- bench/step.py end -->"


def run_json(cmd):
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"step.py: {' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def weft(args, config, sets=(), dump=None, steps=None, warmup=1):
    cmd = [os.path.join(args.build, "weft"), "bench", "step", config,
           "--steps", str(steps or args.steps), "--warmup", str(warmup)]
    if args.peak:
        cmd += ["--peak-flops", str(args.peak)]
    for s in sets:
        cmd += ["--set", s]
    if dump:
        cmd += ["--dump", dump]
    return run_json(cmd)


def simulated_peak(args, config, sets=()):
    """The simulator's peak memory for one process running `config` (FLOP model): what the
    planner believes the step holds (bytes)."""
    cmd = [os.path.join(args.build, "weft"), "simulate", config,
           "--cluster", "configs/clusters/cpu-local.toml", "--world-size", "1"]
    for s in sets:
        cmd += ["--set", s]
    return run_json(cmd)["ranks"][0]["peak_memory_bytes"]


def eager(dump, head):
    return run_json([PY, os.path.join(ROOT, "bench", "eager_reference.py"), dump, "--head", head])


def check_losses(a, b, what):
    for i, (x, y) in enumerate(zip(a["losses"], b["losses"])):
        if abs(x - y) > 2e-2 * abs(y):
            sys.exit(f"step.py: {what}: step {i + 1} loss {x} vs {y}: not the same computation")


def mib(b):
    return b / 2**20


def machine(args):
    torch = subprocess.run([PY, "-c", "import torch; print(torch.__version__)"],
                           capture_output=True, text=True).stdout.strip()
    return f"{results_md.machine()}; PyTorch (Python) {torch}"


def compare(args, config, rounds):
    """weft vs eager vs eager-tgt, `rounds` times on the same dump."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dump = os.path.join(tmp, "dump")
        for r in range(rounds):
            w = weft(args, config, dump=dump if r == 0 else None)  # same batches every round
            e = eager(dump, "all")
            t = eager(dump, "targets")
            check_losses(w, e, f"{config} weft vs eager")
            check_losses(w, t, f"{config} weft vs eager --head targets")
            rows.append((w, e, t))
    return rows


def comparison_table(name, rows, simulated):
    med = lambda xs: statistics.median(xs)
    w = [r[0] for r in rows]
    e = [r[1] for r in rows]
    t = [r[2] for r in rows]
    ratio_e = med([b["median_step_seconds"] / a["median_step_seconds"] for a, b, _ in rows])
    ratio_t = med([c["median_step_seconds"] / a["median_step_seconds"] for a, _, c in rows])
    mem_e = med([b["step_peak_bytes"] / a["step_peak_bytes"] for a, b, _ in rows])
    mem_t = med([c["step_peak_bytes"] / a["step_peak_bytes"] for a, _, c in rows])
    p = w[0]
    lines = [
        f"**{name}** — {p['params'] / 1e6:.1f}M parameters, batch {p['batch']}, "
        f"{p['tokens_per_step']:.0f} tokens/step, {p['precision']}, {p['threads']} threads, "
        f"{len(rows)} rounds of {len(p['step_seconds'])} timed steps",
        "",
        "| implementation | step s (median) | tokens/s | MFU | step peak memory MiB |",
        "|---|---|---|---|---|",
    ]
    for label, runs in (("weft", w), ("PyTorch eager (HF-style full-logit loss)", e),
                        ("PyTorch eager, target-only head", t)):
        lines.append(
            f"| {label} | {med([x['median_step_seconds'] for x in runs]):.3f} | "
            f"{med([x['tokens_per_second'] for x in runs]):.0f} | "
            f"{100 * med([x['mfu'] for x in runs]):.1f}% | "
            f"{mib(med([x['step_peak_bytes'] for x in runs])):.0f} |")
    lines += [
        "",
        f"speed-up of weft (eager step time / weft step time, same round): **{ratio_e:.2f}x** "
        f"vs idiomatic eager, {ratio_t:.2f}x vs eager with the target-only head; "
        f"memory eager/weft: {mem_e:.2f}x, {mem_t:.2f}x; weft's measured / simulated "
        f"(`weft simulate`, the planner's memory model: {mib(simulated):.0f} MiB) peak memory: "
        f"{med([x['step_peak_bytes'] for x in w]) / simulated:.2f}",
        "",
    ]
    return lines, ratio_e


def settings_table(args, title, column, sides, rounds, identical):
    """small-vlm under each of `sides` (label, overrides), the sides taking turns for `rounds`;
    step time and peak memory medians, and the last side's over each other's, per round (their
    median). identical: every side's losses must equal the first's, bit for bit."""
    config = "configs/small-vlm.toml"
    runs = [[] for _ in sides]
    for _ in range(rounds):
        for i, (_, sets) in enumerate(sides):
            runs[i].append(weft(args, config, sets=sets))
    if identical:
        for i in range(1, len(sides)):
            for a, b in zip(runs[0], runs[i]):
                if a["losses"] != b["losses"]:
                    sys.exit(f"step.py: {column}: losses {a['losses']} vs {b['losses']}: "
                             "not identical")
    med = lambda rs, k: statistics.median(r[k] for r in rs)
    last, last_label = runs[-1], sides[-1][0]
    ratio = lambda i, k: statistics.median(b[k] / a[k] for a, b in zip(runs[i], last))
    sim = [simulated_peak(args, config, sets) for _, sets in sides]
    lines = [title, "", f"| {column} | step s (median) | step peak memory MiB | simulated MiB |",
             "|---|---|---|---|"] + [
        f"| {label} | {med(runs[i], 'median_step_seconds'):.3f} | "
        f"{mib(med(runs[i], 'step_peak_bytes')):.0f} | {mib(sim[i]):.0f} |"
        for i, (label, _) in enumerate(sides)] + [""]
    lines += [
        f"{last_label}/{label}, same round: step time **{ratio(i, 'median_step_seconds'):.2f}x**, "
        f"step peak memory {ratio(i, 'step_peak_bytes'):.2f}x (simulated: "
        f"{sim[-1] / sim[i]:.2f}x)" + ("" if i + 2 == len(sides) else ";")
        for i, (label, _) in enumerate(sides[:-1])]
    return lines + [""]


def on_off_table(args, title, column, on, off, sets, rounds, identical):
    """settings_table of two sides: `on` and `off` with sets[True] and sets[False]."""
    return settings_table(args, title, column, [(on, sets[True]), (off, sets[False])], rounds,
                          identical)


def recompute_table(args, rounds):
    every = ["model.llm.recompute=true", "model.vision.recompute=true"]
    half = every + ["model.llm.recompute_blocks=6", "model.vision.recompute_blocks=6"]
    return settings_table(
        args, "**Activation recomputation** (small-vlm: every LLM and ViT block recomputed in "
        "backward, or the first 6 of each module's 12 blocks, `recompute_blocks = 6`)",
        "recompute", [("every block", every), ("first 6 blocks", half), ("off", [])], rounds,
        identical=False)


def cast_once_table(args, rounds):
    sets = {side: ["train.microbatches=4", f"train.cast_once={str(side).lower()}"]
            for side in (True, False)}
    return on_off_table(
        args, "**Parameters cast to bf16 once per step** (small-vlm, batch 8 in 4 microbatches; "
        "`train.cast_once`, model::CastOnce; identical losses checked)", "casts", "once per step",
        "at every use", sets, rounds, identical=True)


def frozen_table(args, rounds):
    frozen = ["model.vision.frozen=true", "model.llm.frozen=true"]
    sets = {side: frozen + [f"train.frozen_fp32={str(not side).lower()}"]
            for side in (True, False)}
    return on_off_table(
        args, "**Frozen modules held in bf16** (small-vlm with the ViT and the LLM frozen, only "
        "the projector training, as LLaVA's first stage; `train.frozen_fp32`; identical losses "
        "checked)", "frozen weights", "bf16 (default)", "fp32 copies", sets, rounds,
        identical=True)


def generate_table(args, rounds, samples=64):
    """Evaluation's greedy captioning (`weft bench generate`): with the KV cache against the
    whole sequence rerun for every token, timed in turn in each of `rounds`."""
    rows = []
    for name in ("tiny-vlm", "small-vlm"):
        r = run_json([os.path.join(args.build, "weft"), "bench", "generate",
                      f"configs/{name}.toml", "--samples", str(samples), "--rounds", str(rounds)])
        rows.append(f"| {name} | {r['samples']} | {r['precision']} | {r['seconds_kv_cache']:.2f} | "
                    f"{r['seconds_whole_sequence']:.2f} | **{r['speedup']:.1f}x** | "
                    f"{r['captions_differing']} |")
    return ["**Evaluation's caption generation** (`weft bench generate CONFIG --samples "
            f"{samples} --rounds {rounds}`: the eval samples' greedy captions at the model's "
            "initial weights, with the KV cache and by rerunning the whole sequence for every "
            "token, in turn; medians)", "",
            "| config | samples | precision | KV cache s | whole sequence s | speed-up | "
            "captions differing |", "|---|---|---|---|---|---|---|"] + rows + [""]


def sweep(args, label, points, sets_of):
    out = []
    for x in points:
        r = weft(args, "configs/small-vlm.toml", sets=sets_of(x), steps=2)
        out.append((x, r))
    return out


def svg_plot(series, path):
    """Two small line charts: step seconds vs sequence length, vs images per sample."""
    w, h, pad = 360, 220, 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * w}" height="{h}" '
             'font-family="sans-serif" font-size="11">']
    for k, (title, xlabel, pts) in enumerate(series):
        ox = k * w
        xs = [p[0] for p in pts]
        ys = [p[1] for p in pts]
        x0, x1 = min(xs), max(xs)
        y1 = max(ys) * 1.1
        sx = lambda x: ox + pad + (x - x0) / max(x1 - x0, 1e-9) * (w - 2 * pad)
        sy = lambda y: h - pad - y / y1 * (h - 2 * pad)
        parts.append(f'<text x="{ox + w / 2}" y="16" text-anchor="middle">{title}</text>')
        parts.append(f'<line x1="{ox + pad}" y1="{h - pad}" x2="{ox + w - pad}" y2="{h - pad}" '
                     'stroke="black"/>')
        parts.append(f'<line x1="{ox + pad}" y1="{pad}" x2="{ox + pad}" y2="{h - pad}" '
                     'stroke="black"/>')
        parts.append(f'<text x="{ox + w / 2}" y="{h - 8}" text-anchor="middle">{xlabel}</text>')
        parts.append(f'<text x="{ox + 6}" y="{pad - 8}">step s</text>')
        pl = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(f'<polyline points="{pl}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
        for x, y in pts:
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="#1f77b4"/>')
            parts.append(f'<text x="{sx(x):.1f}" y="{h - pad + 14}" '
                         f'text-anchor="middle">{x}</text>')
            parts.append(f'<text x="{sx(x) + 4:.1f}" y="{sy(y) - 6:.1f}">{y:.2f}</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def scaling_tables(args):
    synth = ["data.kind=synthetic", "train.batch=2", "data.eval_samples=2"]
    seq = sweep(args, "seq", [256, 512, 1024, 2048],
                lambda s: synth + [f"data.seq_len={s}", f"model.llm.max_seq={s}", "data.images=1"])
    img = sweep(args, "images", [0, 1, 2, 4],
                lambda n: synth + ["data.seq_len=1024", "model.llm.max_seq=1024",
                                   f"data.images={n}"])
    lines = ["**How the step grows** (small-vlm on synthetic data, batch 2; MFU counts the "
             "attention term)", "",
             "| sequence length (1 image) | step s | tokens/s | MFU | time / 256-token time |",
             "|---|---|---|---|---|"]
    base = seq[0][1]["median_step_seconds"]
    for s, r in seq:
        lines.append(f"| {s} | {r['median_step_seconds']:.3f} | {r['tokens_per_second']:.0f} | "
                     f"{100 * r['mfu']:.1f}% | {r['median_step_seconds'] / base:.2f} |")
    lines += ["", "| images per sample (1024 tokens) | step s | tokens/s | MFU | "
              "time / text-only time |", "|---|---|---|---|---|"]
    base = img[0][1]["median_step_seconds"]
    for n, r in img:
        lines.append(f"| {n} | {r['median_step_seconds']:.3f} | {r['tokens_per_second']:.0f} | "
                     f"{100 * r['mfu']:.1f}% | {r['median_step_seconds'] / base:.2f} |")
    svg_plot([("step time vs sequence length", "tokens per sample",
               [(s, r["median_step_seconds"]) for s, r in seq]),
              ("step time vs images per sample", "images (1024 tokens)",
               [(n, r["median_step_seconds"]) for n, r in img])],
             os.path.join(ROOT, "bench", "step_scaling.svg"))
    lines += ["", "![step scaling](step_scaling.svg)", ""]
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--peak", type=float, default=0, help="MFU denominator (default: measure)")
    ap.add_argument("--no-sweeps", action="store_true")
    ap.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()
    args.build = os.path.join(ROOT, args.build) if not os.path.isabs(args.build) else args.build

    peak = run_json([os.path.join(args.build, "weft"), "bench", "peak"])
    if not args.peak:
        args.peak = peak["bf16_flops"]
    lines = [BEGIN, "## Training step: weft vs PyTorch eager (CPU)", "",
             f"Machine: {machine(args)}. Reproduce: `scripts/setup && /usr/bin/python3 "
             "bench/step.py --write`.", "",
             f"Matmul peak (`weft bench peak`, the MFU denominator): bf16 "
             f"{peak['bf16_flops'] / 1e9:.0f} GFLOP/s, fp32 {peak['fp32_flops'] / 1e9:.0f} "
             f"GFLOP/s, {peak['threads']} threads.", "",
             "Both sides run the same model from the same initial weights on the same batches "
             "(`weft bench step --dump`); their losses agree (checked). The eager reference is "
             "`bench/eager_reference.py`: autocast bf16, torch.optim.AdamW, eager attention, "
             "and by default the Hugging Face-style loss over every position's logits.", ""]
    ratios = {}
    for name in ("tiny-vlm", "small-vlm"):
        config = f"configs/{name}.toml"
        table, ratio = comparison_table(name, compare(args, config, args.rounds),
                                        simulated_peak(args, config))
        lines += table
        ratios[name] = ratio
        print("\n".join(table), flush=True)
    rec = recompute_table(args, args.rounds)
    lines += rec
    print("\n".join(rec), flush=True)
    once = cast_once_table(args, args.rounds)
    lines += once
    print("\n".join(once), flush=True)
    held = frozen_table(args, args.rounds)
    lines += held
    print("\n".join(held), flush=True)
    gen = generate_table(args, args.rounds)
    lines += gen
    print("\n".join(gen), flush=True)
    if not args.no_sweeps:
        sc = scaling_tables(args)
        lines += sc
        print("\n".join(sc), flush=True)
    lines.append(END)
    if args.write:
        results_md.write_section(lines, BEGIN, END)


if __name__ == "__main__":
    main()
