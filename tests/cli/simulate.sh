#!/usr/bin/env bash
# `weft simulate`: a Plan on a shipped cluster gives a step prediction (JSON) and a Chrome trace;
# a bad cluster file is a clear error naming the file and key.
set -u
weft=$1; src=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
die() { echo "FAIL: $*"; exit 1; }

"$weft" simulate "$src/configs/tiny-vlm.toml" --cluster "$src/configs/clusters/cpu-local.toml" \
  --set parallel.llm.pp=2 --set train.microbatches=4 --trace "$tmp/trace.json" > "$tmp/sim.json" \
  || die "simulate failed"
python3 - "$tmp/sim.json" "$tmp/trace.json" <<'PY' || die "bad simulate output"
import json, sys
s = json.load(open(sys.argv[1]))
for k in ("step_seconds", "tokens_per_second", "mfu", "mfu_llm_only", "bubble_fraction", "ranks"):
    assert k in s, k
assert s["world_size"] == 2 and s["step_seconds"] > 0 and 0 < s["bubble_fraction"] < 1, s
trace = json.load(open(sys.argv[2]))
assert trace and all(e["ph"] == "X" for e in trace), trace[:2]
print("simulated PP2 step", s["step_seconds"], "s, bubble", round(s["bubble_fraction"], 3), ",", len(trace), "trace events")
PY
"$weft" simulate "$src/configs/h100.toml" --cluster "$src/configs/clusters/cpu-local.toml" > "$tmp/out" 2>&1 \
  && die "a missing config was accepted"
printf 'nodes = "two"\n' > "$tmp/bad.toml"
"$weft" simulate "$src/configs/tiny-vlm.toml" --cluster "$tmp/bad.toml" > "$tmp/out" 2>&1 \
  && die "a bad cluster file was accepted"
grep -q "bad.toml.*nodes" "$tmp/out" || { cat "$tmp/out"; die "error does not name the file and key"; }
echo "bad cluster file: $(grep -o 'error:.*' "$tmp/out" | head -1)"

# `weft bench peak`: the MFU denominators, measured (values are machine-dependent; only their
# presence and sign are checked).
"$weft" bench peak --seconds 0.05 --size 256 > "$tmp/peak.json" || die "bench peak failed"
python3 - "$tmp/peak.json" <<'PY' || die "bad bench peak output"
import json, sys
p = json.load(open(sys.argv[1]))
assert p["bf16_flops"] > 0 and p["fp32_flops"] > 0 and p["threads"] >= 1, p
print("bench peak:", p)
PY
