#!/usr/bin/env python3
"""Training-step benchmark on one GPU: weft against the PyTorch-eager reference, in one run.

    python3 bench/gpu_step.py [--build build-cuda] [--config configs/gpu-1b-vlm.toml]
                              [--steps 10] [--warmup 3] [--device cuda] [--set K=V]...
                              [--ablate K=V[,K=V]]... [--no-ablate]
                              [--compare K=V[,K=V]]... [--no-compare] [--write]

Run it with the Python whose torch (2.x, CUDA) weft was built against (scripts/gpu build): the
eager reference runs under the same interpreter (sys.executable). It runs, one after another:
  weft    `BUILD/weft bench step CONFIG --steps N --warmup W --set train.device=DEVICE --dump DIR`
          (the real Trainer step, timed in-process; on a GPU step i + 1 is queued before
          step i's loss is read, so a step's time runs from one step's finish to the next)
  eager   `bench/eager_reference.py DIR --device DEVICE` (the same model, weights, batches and
          steps in idiomatic PyTorch: autocast bf16, torch.optim.AdamW,
          scaled_dot_product_attention, Hugging Face-style loss over every position's logits;
          timed the same way: the next step queued before a CUDA event says this one is done)
and then weft again with each ablation (--ablate K=V[,K=V...], repeatable: one run each, with
all its overrides), each row with its step time against weft's in the same run, MFU against the
same denominator, and whether its losses are weft's (an override that changes the computation
is reported there). By default: `model.llm.attention_chunk=0` (attention as one SDPA call with
the mask instead of tiles); and `train.batch=32,train.microbatches=4,train.cast_once=false`
(each parameter cast at every use instead of once per step, at the batch of the comparison
below). Then weft and eager again, side by side on
their own dump, for each comparison (--compare K=V[,K=V...], repeatable; by default
`train.batch=32,train.microbatches=4`: 4 microbatches of weft's batch per optimizer step, as
training with gradient accumulation runs, the optimizer's and the casts' cost spread over 4x the
tokens; the eager reference accumulates gradients over the same microbatches). Each comparison
checks that their losses agree (bf16: 2e-2 relative, as bench/step.py) and prints a markdown
table of the median step time, tokens/s, MFU and peak memory of both, and eager/weft. MFU: weft's
own field; eager's is computed from the dump's bench.json with the same FLOPs per timed step and
the same peak (weft's measured matmul peak on the device), as step.py does. Peak memory on CUDA
is the device's peak allocated memory over the steps (weft: device_peak_bytes, eager:
torch.cuda.max_memory_allocated()); with --device cpu (to exercise the driver on a machine
without a GPU) it is the process's peak RSS over the steps minus its RSS before the model, as in
step.py. --write replaces this script's section of bench/RESULTS.md (appended when absent).
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

import results_md  # bench/RESULTS.md sections

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- bench/gpu_step.py begin -->", "<!-- bench/gpu_step.py end -->"
TOLERANCE = 2e-2  # relative loss difference allowed in bf16 (bench/step.py's)
# Dense bf16 datasheet peaks (FLOP/s), the MFU denominator the field uses (../REFERENCES: H100 and
# H200 SXM 989 TFLOP/s); other devices: weft's measured matmul peak.
DATASHEET_BF16 = {"H100": 989e12, "H200": 989e12}
# Further weft-vs-eager comparisons, each on its own dump: gradient accumulation, as a 1B model
# trains (4 microbatches of the config's batch per optimizer step).
DEFAULT_COMPARES = ["train.batch=32,train.microbatches=4"]
DEFAULT_ABLATIONS = ["model.llm.attention_chunk=0",
                     "train.batch=32,train.microbatches=4,train.cast_once=false"]


def datasheet_peak():
    import torch  # the interpreter's torch (2.x with CUDA on the GPU machine)
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in DATASHEET_BF16.items() if k in name), 0.0), name


def run_json(cmd):
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"gpu_step.py: {' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    try:
        return json.loads(out.stdout)
    except ValueError:
        sys.exit(f"gpu_step.py: {' '.join(cmd)} did not print JSON:\n{out.stdout[-3000:]}")


def loss_mismatch(a, b):
    """Why a's losses are not b's (None when they agree within TOLERANCE)."""
    if len(a["losses"]) != len(b["losses"]):
        return f"{len(a['losses'])} vs {len(b['losses'])} losses"
    for i, (x, y) in enumerate(zip(a["losses"], b["losses"])):
        if abs(x - y) > TOLERANCE * abs(y):
            return f"step {i + 1} loss {x} vs {y}"
    return None


def check_losses(a, b, what):
    why = loss_mismatch(a, b)
    if why:
        sys.exit(f"gpu_step.py: {what}: {why}: not the same computation")


def mib(b):
    return b / 2**20


def ratio(a, b):
    return f"{a / b:.2f}x" if b else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build-cuda", help="weft's build directory")
    ap.add_argument("--config", default="configs/gpu-1b-vlm.toml")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="train.device for weft and --device for the eager reference "
                    "(cpu: only to exercise this script without a GPU)")
    ap.add_argument("--peak-flops", type=float, default=None,
                    help="MFU denominator (default: the device's bf16 datasheet peak when known, "
                    "else weft's measured matmul peak)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for weft (and so for the dump both sides run), "
                    "e.g. model.llm.attention_chunk=0; repeatable")
    ap.add_argument("--ablate", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                    help="also time weft with these overrides, one run, in the same run as the "
                    "rest (repeatable; default: " + "; ".join(DEFAULT_ABLATIONS) + ")")
    ap.add_argument("--no-ablate", action="store_true", help="no ablation runs")
    ap.add_argument("--compare", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                    help="also compare weft with the eager reference under these overrides, "
                    "both on one dump (repeatable; default: " + "; ".join(DEFAULT_COMPARES) + ")")
    ap.add_argument("--no-compare", action="store_true", help="no further comparisons")
    ap.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()
    build = args.build if os.path.isabs(args.build) else os.path.join(ROOT, args.build)
    cuda = args.device == "cuda"
    peak_flops = args.peak_flops
    if peak_flops is None:
        peak_flops = datasheet_peak()[0] if cuda else 0.0
    peak_note = ("the device's bf16 datasheet peak" if args.peak_flops is None and peak_flops
                 else "the given peak" if peak_flops else
                 "weft's measured matmul peak on the " + ("device" if cuda else "CPU"))

    ablations = [] if args.no_ablate else (args.ablate or DEFAULT_ABLATIONS)
    compares = [] if args.no_compare else (args.compare or DEFAULT_COMPARES)

    def weft(extra, dump=None, peak=peak_flops):
        return run_json([os.path.join(build, "weft"), "bench", "step", args.config,
                         "--steps", str(args.steps), "--warmup", str(args.warmup),
                         "--set", f"train.device={args.device}"]
                        + (["--dump", dump] if dump else [])
                        + [a for kv in args.set + extra for a in ("--set", kv)]
                        + (["--peak-flops", str(peak)] if peak else []))

    def device_peak(r):
        return r.get("device_peak_bytes", r["step_peak_bytes"]) if cuda else r["step_peak_bytes"]

    def compare(extra):
        """weft and the eager reference on one dump: (weft's json, eager's, its table lines)."""
        with tempfile.TemporaryDirectory() as tmp:
            dump = os.path.join(tmp, "dump")
            w = weft(extra, dump)
            e = run_json([sys.executable, os.path.join(ROOT, "bench", "eager_reference.py"),
                          dump, "--device", args.device])
            with open(os.path.join(dump, "bench.json")) as f:
                bench = json.load(f)
        overrides = args.set + extra
        check_losses(w, e, f"{args.config} {' '.join(overrides)} weft vs eager")
        # Eager MFU with weft's FLOPs per step and weft's peak (the dump's bench.json).
        timed = bench["step"][bench["warmup"]:]
        flops, peak = sum(s["flops"] for s in timed), bench["peak_flops"]
        eager_s = sum(e["step_seconds"])
        eager_mfu = flops / eager_s / peak if eager_s > 0 and peak > 0 else 0.0
        w_mem, e_mem = device_peak(w), e["step_peak_bytes"]  # eager's: the device's with cuda
        ws, es = w["median_step_seconds"], e["median_step_seconds"]
        lines = [
            f"**{name}** — {w['params'] / 1e6:.1f}M parameters ({w['trainable_params'] / 1e6:.1f}M "
            f"trainable), batch {w['batch']}"
            + (f" in {w['microbatches']} microbatches" if w.get("microbatches", 1) > 1 else "")
            + f", {w['tokens_per_step']:.0f} tokens/step, {w['precision']}, on "
            f"{w.get('device', args.device)}, {args.warmup} warmup + {args.steps} timed steps"
            + (", with " + ", ".join(f"`{kv}`" for kv in overrides) if overrides else ""),
            "",
            "| implementation | step s (median) | tokens/s | MFU | peak memory MiB |",
            "|---|---|---|---|---|",
            f"| weft | {ws:.3f} | {w['tokens_per_second']:.0f} | {100 * w['mfu']:.1f}% | "
            f"{mib(w_mem):.0f} |",
            f"| PyTorch eager (HF-style full-logit loss) | {es:.3f} | "
            f"{e['tokens_per_second']:.0f} | {100 * eager_mfu:.1f}% | {mib(e_mem):.0f} |",
            f"| eager / weft | {ratio(es, ws)} | {ratio(e['tokens_per_second'], w['tokens_per_second'])} | "
            f"{ratio(eager_mfu, w['mfu'])} | {ratio(e_mem, w_mem)} |",
            "",
            f"speed-up of weft (eager step time / weft step time): **{ratio(es, ws)}**; "
            f"memory eager/weft: {ratio(e_mem, w_mem)}",
            "",
        ]
        return w, e, lines

    name = os.path.splitext(os.path.basename(args.config))[0]
    w, e, table = compare([])
    # Ablations: MFU against weft's own denominator; an override that changes the computation
    # (its losses differ from weft's) is reported in its row, not an error.
    ablated = []
    for kv in ablations:
        a = weft(kv.split(","), peak=w["peak_flops"])
        ablated.append((kv, a, loss_mismatch(a, w) if a["tokens_per_step"] == w["tokens_per_step"]
                            else None))
    ws = w["median_step_seconds"]
    if ablated:
        table += ["| weft with | step s (median) | step / weft's | tokens/s | MFU | "
                  "peak memory MiB | losses |",
                  "|---|---|---|---|---|---|---|"]
        for kv, a, why in ablated:
            losses = (f"another batch ({a['batch']} rows, {a['tokens_per_step']:.0f} tokens/step)"
                      if a["tokens_per_step"] != w["tokens_per_step"] else
                      f"differ: {why}" if why else "same as weft's")
            table.append(f"| `{kv}` | {a['median_step_seconds']:.3f} | "
                         f"{ratio(a['median_step_seconds'], ws)} | "
                         f"{a['tokens_per_second']:.0f} | {100 * a['mfu']:.1f}% | "
                         f"{mib(device_peak(a)):.0f} | {losses} |")
        table.append("")
    for kv in compares:
        table += compare(kv.split(","))[2]
    print("\n".join(table), flush=True)
    device = e.get("device_name", results_md.machine()) if cuda else results_md.machine()
    memory = ("device memory, peak allocated over the steps" if cuda else
              "process peak RSS over the steps minus RSS before the model")
    attention = e.get("attention", "eager")
    peak = w["peak_flops"]

    if args.write:
        repro = "python3 bench/gpu_step.py --write"
        for opt, default in (("build", "build-cuda"), ("config", "configs/gpu-1b-vlm.toml"),
                             ("steps", 10), ("warmup", 3), ("device", "cuda")):
            if getattr(args, opt) != default:
                repro += f" --{opt} {getattr(args, opt)}"
        if args.peak_flops is not None:
            repro += f" --peak-flops {args.peak_flops}"
        repro += "".join(f" --set {shlex.quote(kv)}" for kv in args.set)
        repro += (" --no-ablate" if args.no_ablate else
                  "".join(f" --ablate {shlex.quote(kv)}" for kv in args.ablate))
        repro += (" --no-compare" if args.no_compare else
                  "".join(f" --compare {shlex.quote(kv)}" for kv in args.compare))
        lines = [BEGIN, "## Training step on one GPU: weft vs PyTorch eager", "",
                 f"Device: {device}; PyTorch (Python) {e['torch']} ({attention} attention), "
                 f"weft built against LibTorch {w['torch']}. Host: {results_md.machine()}. "
                 f"Reproduce: `scripts/gpu build && {repro}`.", "",
                 "Both sides run the same model from the same initial weights on the same "
                 "batches (`weft bench step --dump`); their losses agree (checked). MFU "
                 f"denominator: {peak_note}, "
                 f"{peak / 1e12:.1f} TFLOP/s, with the same FLOPs per step for both. Peak "
                 f"memory: {memory}.", ""]
        lines += table
        lines.append(END)
        results_md.write_section(lines, BEGIN, END)


if __name__ == "__main__":
    main()
