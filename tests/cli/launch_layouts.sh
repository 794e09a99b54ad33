#!/usr/bin/env bash
# `weft launch --nproc 4` with real processes trains configs/tiny-vlm.toml under a mixed layout —
# the vision encoder data-parallel over 4 ranks feeding an LLM with tp=2 x pp=2 — and matches
# the single-process loss curve (fp32).
set -u
weft=$1; src=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
die() { echo "FAIL: $*"; exit 1; }
# 6 LLM blocks and a vocabulary of 8192: the stage cut on the data's sample ([4]) is not full
# rows' ([5]), whose loss on every position makes the head weigh more.
common=(--set data.eval_samples=16 --set train.precision=fp32 --set train.steps=4
        --set train.warmup=1 --set train.batch=16 --set train.microbatches=2
        --set train.threads=1 --set model.llm.layers=6 --set model.llm.vocab=8192)
layout=(--set parallel.vision.dp=4 --set parallel.llm.tp=2 --set parallel.llm.pp=2)

"$weft" train "$src/configs/tiny-vlm.toml" "${common[@]}" --out "$tmp/single" --quiet \
  || die "single-process run failed"
"$weft" launch --nproc 4 -- "$weft" train "$src/configs/tiny-vlm.toml" "${common[@]}" \
  "${layout[@]}" --out "$tmp/mixed" > "$tmp/mixed.log" 2>&1 \
  || { cat "$tmp/mixed.log"; die "4-rank mixed-layout launch failed"; }
grep -q '"world_size": 4' "$tmp/mixed/summary.json" || die "summary does not record world_size 4"
grep -q '"tp": 2' "$tmp/mixed/plan.json" || die "plan.json does not record the layout"
# The run's plan is the one `weft plan` prints (its LLM stages cut on the data's mean sample),
# not the full rows' one.
"$weft" plan "$src/configs/tiny-vlm.toml" --world-size 4 "${common[@]}" "${layout[@]}" \
  > "$tmp/printed.json" || die "weft plan failed"
"$weft" plan "$src/configs/tiny-vlm.toml" --world-size 4 "${common[@]}" "${layout[@]}" \
  --full-rows > "$tmp/full.json" || die "weft plan --full-rows failed"
python3 - "$tmp/printed.json" "$tmp/mixed/plan.json" "$tmp/full.json" <<'PY' \
  || die "the run's plan is not weft plan's"
import json, sys
printed, ran, full = (json.load(open(p)) for p in sys.argv[1:])
assert printed == ran, (printed, ran)
cut = lambda p: [m["stage_boundaries"] for m in p["modules"] if m["name"] == "llm"]
assert cut(full) != cut(ran), (cut(full), cut(ran))
print("the run's LLM cut", cut(ran), "is weft plan's (full rows:", cut(full), ")")
PY
python3 "$src/tests/cli/lib/same_losses.py" "$tmp/single/metrics.jsonl" \
  "$tmp/mixed/metrics.jsonl" 4 "vision dp4 -> llm tp2 x pp2 on 4 processes" || die "losses differ"
# The run's timeline of step 3, every rank in it (the simulator's trace format).
python3 - "$tmp/mixed/trace.json" <<'PY' || die "trace.json missing or incomplete"
import json, sys
t = json.load(open(sys.argv[1]))
assert {e["tid"] for e in t} == {0, 1, 2, 3}, {e["tid"] for e in t}
names = {e["name"] for e in t}
for n in ("vision fwd mb0 s0", "llm fwd mb1 s1", "llm bwd mb0 s0", "llm grad all-reduce"):
    assert n in names, (n, sorted(names))
assert all(e["ph"] == "X" and e["dur"] >= 0 for e in t)
print(len(t), "trace events from 4 ranks")
PY
# Time blocked in the LLM's TP collectives is reported per step (none in the single process).
python3 - "$tmp/mixed/metrics.jsonl" "$tmp/single/metrics.jsonl" <<'PY' || die "collective_wait_seconds"
import json, sys
mixed = [json.loads(l) for l in open(sys.argv[1])]
single = [json.loads(l) for l in open(sys.argv[2])]
assert all(0 < m["collective_wait_seconds"] < m["compute_seconds"] for m in mixed), mixed
assert all("collective_wait_seconds" not in s for s in single), single[0]
print("collective wait per step:", [round(m["collective_wait_seconds"], 4) for m in mixed])
PY
