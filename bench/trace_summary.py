#!/usr/bin/env python3
"""Where a profiled step's time went, from the Chrome trace `weft bench step --profile FILE` writes.

    python3 bench/trace_summary.py TRACE.json [--top 15] [--sources 12]

A CUDA build writes a Kineto trace: its GPU kernels are grouped by kind (matmuls, attention,
weft's own kernels, copies and casts, ...) with their summed device time, and the GPU's idle time
(the span of the step's kernels less their summed time: the GPU waiting on the CPU). A CPU build
writes weft's trace of operators: they are summed by name (time includes the operators they
call), with the step's ops (weft's spans, "llm fwd mb0 s0") and asynchronous ones (Gloo's
collectives, in flight while other work runs) apart. Either way the heaviest entries follow, by
name. Then where the copies come from: for the kinds "copies and casts" and "other element-wise"
(GPU), or the copying operators (CPU), the operator paths that ran them (the innermost operator,
its callers and the backward node it ran under) with the innermost operator's input shapes,
heaviest first.
"""
import argparse
import collections
import json
import sys

# Kernel name fragments (lower case) → kind; the first match wins.
KINDS = [
    (("fmha", "flash", "attention", "cudnn", "sdpa"), "attention"),  # before "cutlass": fmha_cutlass*
    (("gemm", "cutlass", "nvjet", "cublas", "xmma"), "matmuls"),
    (("adam",), "AdamW"),
    (("rms_norm",), "weft RMSNorm"),
    (("swiglu",), "weft SwiGLU"),
    (("rope_kernel",), "weft RoPE"),
    (("layer_norm", "layernorm"), "LayerNorm"),
    (("softmax", "nll_loss", "cross_entropy"), "loss"),
    (("nccl",), "NCCL"),
    (("reduce_kernel",), "reductions"),
    (("copy", "cast", "catarray"), "copies and casts"),
    (("elementwise", "vectorized"), "other element-wise"),
]


def kind_of(name):
    low = name.lower()
    for fragments, kind in KINDS:
        if any(f in low for f in fragments):
            return kind
    return "other"


# CPU operators that copy a tensor's data (a CPU trace's "copies").
COPY_OPS = {"aten::copy_", "aten::_to_copy", "aten::clone", "aten::cat", "aten::contiguous",
            "aten::index_copy", "aten::index_add"}


def op_paths(ops):
    """Each CPU operator's path: its own name after those of the operators it runs inside (by
    time, on its thread), the autograd engine's wrappers left out; and its input shapes."""
    order = sorted(range(len(ops)), key=lambda i: (ops[i]["tid"], ops[i]["ts"], -ops[i]["dur"]))
    paths = [None] * len(ops)
    stack = []  # indices of the operators still open on this thread
    for i in order:
        e = ops[i]
        while stack and not (ops[stack[-1]]["tid"] == e["tid"] and
                             e["ts"] < ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"]):
            stack.pop()
        outer = paths[stack[-1]] if stack else ()
        name = e["name"]
        paths[i] = outer if name.startswith("autograd::engine") else outer + (name,)
        stack.append(i)
    return paths


def covered(events):
    """The time inside any recorded range on the busiest thread: the union of its ranges."""
    counts = collections.Counter(e["tid"] for e in events)
    ranges = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                    if e["tid"] == counts.most_common(1)[0][0])
    total, end = 0.0, float("-inf")
    for a, b in ranges:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def path_label(path, shapes, depth=4):
    shown = " > ".join(path[-depth:]) or "(no operator)"
    dims = [d for d in (shapes or []) if d]  # scalars and absent arguments have no dims
    return f"{shown} {dims[:3]}" if dims else shown


def sources(title, rows, total, top):
    print(f"\n{title}:\n")
    table(sorted(rows.items(), key=lambda kv: -kv[1][1])[:top], total, "the span")


def table(rows, total, unit_total_label):
    total = max(total, 1e-9)
    print(f"| what | calls | ms | share of {unit_total_label} |")
    print("|---|---|---|---|")
    for name, (calls, us) in rows:
        print(f"| {name} | {calls} | {us / 1e3:.2f} | {100 * us / total:.0f}% |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15, help="heaviest entries listed by name")
    ap.add_argument("--sources", type=int, default=12,
                    help="operator paths listed for the copies and element-wise kernels (0: none)")
    a = ap.parse_args()
    try:
        with open(a.trace) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"trace_summary.py: {a.trace}: not a readable JSON trace ({e})")
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    events = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e]
    if not events:
        sys.exit(f"trace_summary.py: {a.trace}: no timed events")
    kernels = [e for e in events if e.get("cat") == "kernel"]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    if kernels:
        span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
        busy = sum(e["dur"] for e in kernels)
        by_kind = collections.defaultdict(lambda: [0, 0.0])
        for e in kernels:
            for d in (by_kind[kind_of(e["name"])], by_name[e["name"][:100]]):
                d[0] += 1
                d[1] += e["dur"]
        rows = sorted(by_kind.items(), key=lambda kv: -kv[1][1])
        rows.append(("GPU idle (waiting for launches)", [0, max(span - busy, 0.0)]))
        print(f"{len(kernels)} GPU kernels over {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms\n")
        table(rows, span, "the step's kernel span")
    else:
        # CPU trace: top-level time per operator name (nested calls are inside their callers).
        # Asynchronous operations (weft's recorder: category "async", Gloo's collectives) run
        # while other work does: their time in flight is listed apart.
        span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
        in_flight = collections.defaultdict(lambda: [0, 0.0])
        step_ops = collections.defaultdict(lambda: [0, 0.0])  # user-scope ranges: weft's spans
        for e in events:
            cat = e.get("cat")
            d = (in_flight if cat == "async" else step_ops if cat == "user_annotation"
                 else by_name)[e["name"]]
            d[0] += 1
            d[1] += e["dur"]
        print(f"{len(events)} operators over {span / 1e3:.1f} ms (CPU times, nested included)")
        inside = covered([e for e in events if e.get("cat") != "async"])
        print(f"{inside / 1e3:.1f} ms of it inside recorded operators or the step's ops on the "
              f"busiest thread ({100 * inside / max(span, 1e-9):.0f}%)\n")
        if step_ops:
            print("\nthe step's ops (as trace.json names them):\n")
            table(sorted(step_ops.items(), key=lambda kv: -kv[1][1])[:a.top], span, "the span")
        if in_flight:
            print("\nasynchronous operations (time in flight, beside the operators below):\n")
            table(sorted(in_flight.items(), key=lambda kv: -kv[1][1])[:a.top], span, "the span")
    print(f"\nheaviest {'kernels' if kernels else 'operators'}:\n")
    table(sorted(by_name.items(), key=lambda kv: -kv[1][1])[:a.top], span, "the span")
    if a.sources <= 0:
        return
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    paths = op_paths(ops)
    if kernels:
        # A kernel's "External id" is that of the innermost operator that launched it.
        by_id = {}
        for e, path in zip(ops, paths):
            ext = e.get("args", {}).get("External id")
            if ext is not None:
                by_id[ext] = (path, e.get("args", {}).get("Input Dims"))
        for kind in ("copies and casts", "other element-wise"):
            rows = collections.defaultdict(lambda: [0, 0.0])
            for e in kernels:
                if kind_of(e["name"]) != kind:
                    continue
                path, shapes = by_id.get(e.get("args", {}).get("External id"), ((), None))
                d = rows[path_label(path, shapes)]
                d[0] += 1
                d[1] += e["dur"]
            if rows:
                sources(f"where the {kind} kernels come from", rows, span, a.sources)
    else:
        rows = collections.defaultdict(lambda: [0, 0.0])
        for e, path in zip(ops, paths):
            if e["name"] in COPY_OPS and not any(n in COPY_OPS for n in path[:-1]):
                d = rows[path_label(path, e.get("args", {}).get("Input Dims"))]
                d[0] += 1
                d[1] += e["dur"]
        if rows:
            sources("where the copies come from (copying operators, outermost)", rows, span,
                    a.sources)


if __name__ == "__main__":
    main()
