#!/usr/bin/env bash
# `weft bench step`: its JSON is complete and sane, and bench/eager_reference.py — the PyTorch
# eager reference the step benchmark compares against — computes the same thing: fed weft's
# dumped weights and batches, in fp32 its losses and gradient norms match weft's within 1e-5
# relative, with the full-logit and the target-only head, for the vision-only and the
# vision + audio configs. `weft bench generate` times cached decoding against the whole
# sequence and they caption alike. Bad flags are clear errors.
set -u
weft=$1; src=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
die() { echo "FAIL: $*"; exit 1; }
# A Python with torch and numpy: Debian's (python3-torch) here, the PATH's (pip torch) on a GPU
# machine.
py=
for p in /usr/bin/python3 python3; do
  if "$p" -c 'import numpy, torch' 2> /dev/null; then py=$p; break; fi
done
[ -n "$py" ] || die "no python3 with torch and numpy (scripts/setup installs python3-torch)"

for cfg in tiny-vlm tiny-valm; do
  "$weft" bench step "$src/configs/$cfg.toml" --set train.precision=fp32 --set train.batch=16 \
    --set train.microbatches=2 --steps 2 --warmup 1 --peak-flops 1e11 --dump "$tmp/$cfg" \
    --json "$tmp/$cfg.weft.json" > /dev/null || die "$cfg: weft bench step failed"
  for head in all targets; do
    "$py" "$src/bench/eager_reference.py" "$tmp/$cfg" --head $head \
      --json "$tmp/$cfg.$head.json" > /dev/null || die "$cfg: eager reference ($head) failed"
  done
  "$py" - "$tmp/$cfg" <<'PY' || die "$cfg: weft and the eager reference disagree"
import json, sys
d = sys.argv[1]
w = json.load(open(d + ".weft.json"))
assert w["impl"] == "weft" and len(w["losses"]) == 3 and len(w["step_seconds"]) == 2, w
assert w["median_step_seconds"] > 0 and w["tokens_per_second"] > 0 and 0 < w["mfu"], w
assert w["step_peak_bytes"] > 0 and w["peak_rss_bytes"] > w["step_peak_bytes"], w
for head in ("all", "targets"):
    e = json.load(open(d + "." + head + ".json"))
    for key in ("losses", "grad_norms"):
        for a, b in zip(w[key], e[key]):
            assert abs(a - b) <= 1e-5 * abs(b), (head, key, w[key], e[key])
print(d.rsplit("/", 1)[1], "fp32 losses", ["%.6f" % x for x in w["losses"]], "match the eager reference")
PY
done

# --profile: a Chrome trace of the last step, which bench/trace_summary.py reads (operators on a
# CPU build, GPU kernels on a CUDA one).
"$weft" bench step "$src/configs/tiny-vlm.toml" --steps 1 --warmup 0 --peak-flops 1e11 \
  --profile "$tmp/trace.json" > /dev/null || die "bench step --profile failed"
"$py" "$src/bench/trace_summary.py" "$tmp/trace.json" --top 5 > "$tmp/summary" \
  || die "trace_summary.py failed on the trace"
grep -Eq "^\| (aten::|matmuls)" "$tmp/summary" || { cat "$tmp/summary"; die "no operators or kernels in the summary"; }
grep -Eq "^\| (aten::to > aten::_to_copy|.*aten::copy_) \[\[" "$tmp/summary" \
  || { cat "$tmp/summary"; die "no copies with their callers and shapes in the summary"; }
# A CPU trace covers the step: weft's own kernels and waits are ranges too (no GPU kernels here).
if ! grep -q "GPU kernels" "$tmp/summary"; then
  inside=$(sed -n 's/.*inside recorded operators.*(\([0-9]*\)%)$/\1/p' "$tmp/summary")
  [ -n "$inside" ] && [ "$inside" -ge 90 ] \
    || { cat "$tmp/summary"; die "the trace leaves ${inside:-?}% of the step outside any range (want >= 90%)"; }
fi
# A Kineto-style trace: each kernel is put under the operator path that launched it.
cat > "$tmp/kineto.json" <<'JSON'
{"traceEvents": [
 {"ph": "X", "cat": "cpu_op", "name": "aten::to", "tid": 1, "ts": 0, "dur": 10, "args": {"External id": 1, "Input Dims": [[4, 8], []]}},
 {"ph": "X", "cat": "cpu_op", "name": "aten::_to_copy", "tid": 1, "ts": 1, "dur": 8, "args": {"External id": 2, "Input Dims": [[4, 8], []]}},
 {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "tid": 1, "ts": 2, "dur": 6, "args": {"External id": 3, "Input Dims": [[4, 8], [4, 8]]}},
 {"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: AddBackward0", "tid": 2, "ts": 20, "dur": 10, "args": {"External id": 4}},
 {"ph": "X", "cat": "cpu_op", "name": "AddBackward0", "tid": 2, "ts": 21, "dur": 8, "args": {"External id": 5}},
 {"ph": "X", "cat": "cpu_op", "name": "aten::add", "tid": 2, "ts": 22, "dur": 6, "args": {"External id": 6, "Input Dims": [[16], [16], []]}},
 {"ph": "X", "cat": "kernel", "name": "void at::native::unrolled_elementwise_kernel<copy>", "ts": 5, "dur": 3, "args": {"External id": 3}},
 {"ph": "X", "cat": "kernel", "name": "void at::native::vectorized_elementwise_kernel<add>", "ts": 24, "dur": 2, "args": {"External id": 6}},
 {"ph": "X", "cat": "kernel", "name": "ampere_bf16_gemm", "ts": 30, "dur": 5, "args": {"External id": 99}}
]}
JSON
"$py" "$src/bench/trace_summary.py" "$tmp/kineto.json" > "$tmp/summary" || die "trace_summary.py failed on a Kineto trace"
grep -q "^| aten::to > aten::_to_copy > aten::copy_ \[\[4, 8\], \[4, 8\]\] | 1 | 0.00 |" "$tmp/summary" \
  && grep -q "^| AddBackward0 > aten::add \[\[16\], \[16\]\] | 1 |" "$tmp/summary" \
  || { cat "$tmp/summary"; die "kernels not put under the operators that launched them"; }
echo '{"traceEvents": []}' > "$tmp/empty.json"
"$py" "$src/bench/trace_summary.py" "$tmp/empty.json" > "$tmp/out" 2>&1 && die "an empty trace was summarised"
grep -q "empty.json" "$tmp/out" || { cat "$tmp/out"; die "trace_summary error does not name the file"; }

"$weft" bench step "$src/configs/tiny-vlm.toml" --steps 0 > "$tmp/out" 2>&1 && die "--steps 0 accepted"
grep -q -- "--steps" "$tmp/out" || { cat "$tmp/out"; die "unclear error for --steps 0"; }
"$weft" bench step "$tmp/none.toml" > "$tmp/out" 2>&1 && die "a missing config was accepted"
grep -q "none.toml" "$tmp/out" || { cat "$tmp/out"; die "error does not name the config"; }
# `weft bench generate`: both ways timed, the same captions in fp32.
"$weft" bench generate "$src/configs/tiny-vlm.toml" --set train.precision=fp32 --samples 12 \
  > "$tmp/gen.json" || die "weft bench generate failed"
"$py" - "$tmp/gen.json" <<'PY' || { cat "$tmp/gen.json"; die "weft bench generate's JSON"; }
import json, sys
g = json.load(open(sys.argv[1]))
assert g["samples"] == 12 and g["captions_differing"] == 0, g
assert g["seconds_kv_cache"] > 0 and g["seconds_whole_sequence"] > 0, g
assert abs(g["speedup"] - g["seconds_whole_sequence"] / g["seconds_kv_cache"]) < 1e-9, g
PY
"$weft" bench generate "$src/configs/tiny-vlm.toml" --samples 0 > "$tmp/out" 2>&1 \
  && die "--samples 0 accepted"
grep -q -- "--samples" "$tmp/out" || { cat "$tmp/out"; die "unclear error for --samples 0"; }
"$py" "$src/bench/eager_reference.py" "$tmp/nothing" > "$tmp/out" 2>&1 \
  && die "the reference accepted a missing dump"
grep -q "nothing" "$tmp/out" || { cat "$tmp/out"; die "reference error does not name the dump"; }
echo "PASS"
