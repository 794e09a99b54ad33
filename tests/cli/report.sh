#!/usr/bin/env bash
# `weft report`: a real short run's directory gives one self-contained HTML page with the loss
# curve, throughput, where each step's time went, balance charts and the pipeline timeline of the traced step; with --sim the
# simulator's timeline is drawn under the measured one; a `weft simulate --trace` JSON reports on
# its own; nothing on the page is fetched from the network; bad inputs are clear errors.
set -u
weft=$(cd "$(dirname "$1")" && pwd)/$(basename "$1"); src=$(cd "$2" && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
die() { echo "FAIL: $*"; exit 1; }
common=(--set train.steps=4 --set train.warmup=1 --set train.batch=16 --set train.microbatches=2
        --set data.eval_samples=16 --set train.threads=1 --set output.trace_step=3)

"$weft" launch --nproc 2 -- "$weft" train "$src/configs/tiny-vlm.toml" "${common[@]}" \
  --set parallel.llm.pp=2 --set parallel.vision.dp=2 --out "$tmp/run" > "$tmp/train.log" 2>&1 \
  || { cat "$tmp/train.log"; die "training run failed"; }
"$weft" simulate "$src/configs/tiny-vlm.toml" --cluster "$src/configs/clusters/cpu-local.toml" \
  "${common[@]}" --set parallel.llm.pp=2 --set parallel.vision.dp=2 \
  --trace "$tmp/sim-trace.json" > "$tmp/sim.json" || die "simulate failed"

"$weft" report "$tmp/run" --sim "$tmp/sim.json" --out "$tmp/report.html" > "$tmp/out" \
  || die "weft report failed"
/usr/bin/python3 - "$tmp/report.html" <<'PY' || die "bad run report"
import re, sys
html = open(sys.argv[1], encoding="utf-8").read()
assert html.startswith("<!doctype html>"), html[:40]
for needle in ('<svg class="chart" id="loss"', 'id="throughput"', 'id="balance"',
               '<svg class="timeline" id="timeline-0"', '<svg class="timeline" id="timeline-1"',
               "Measured (trace.json)", "Predicted (simulator)", "measured / predicted",
               'id="time"', "waiting for pipeline messages", "in TP / CP / EP / SP collectives"):
    assert needle in html, needle
time = re.search(r'<svg class="chart" id="time".*?</svg>', html, re.S).group(0)
assert time.count('<polyline class="series"') == 7, time.count('<polyline class="series"')
loss = re.search(r'<svg class="chart" id="loss".*?</svg>', html, re.S).group(0)
points = re.search(r'<polyline class="series"[^>]*points="([^"]*)"', loss).group(1).split()
assert len(points) == 4, points  # one point per step
timeline = re.search(r'<svg class="timeline" id="timeline-0".*?</svg>', html, re.S).group(0)
for name in ("vision fwd mb0 s0", "llm fwd mb1 s1", "llm bwd mb0 s0"):
    assert "<title>" + name in timeline, name
assert "rank 0" in timeline and "rank 1" in timeline
for bad in ("http://", "https://", "<script", "<link", "@import", "src="):
    assert bad not in html, bad
print("run report: %d bytes, %d timeline events measured" % (len(html), timeline.count("<rect")))
PY

# The simulation on its own: the JSON names its trace (relative paths work from the JSON's folder).
(cd "$tmp" && "$weft" simulate "$src/configs/tiny-vlm.toml" \
  --cluster "$src/configs/clusters/cpu-local.toml" "${common[@]}" --set parallel.llm.pp=2 \
  --set parallel.vision.dp=2 --trace rel-trace.json > rel-sim.json) || die "simulate failed"
"$weft" report "$tmp/rel-sim.json" > "$tmp/out" || die "weft report on a simulation failed"
[ -f "$tmp/rel-sim.html" ] || die "no report next to the simulation JSON"
/usr/bin/python3 - "$tmp/rel-sim.html" <<'PY' || die "bad simulation report"
import sys
html = open(sys.argv[1], encoding="utf-8").read()
for needle in ('id="timeline-0"', 'id="ranks-time"', 'id="ranks-memory"', "predicted step", "<table>"):
    assert needle in html, needle
assert "http://" not in html and "https://" not in html
print("simulation report:", len(html), "bytes")
PY

"$weft" report "$tmp/nowhere" > "$tmp/err" 2>&1 && die "a missing input was accepted"
grep -q "nowhere: no such run directory or simulation JSON" "$tmp/err" \
  || { cat "$tmp/err"; die "unclear error for a missing input"; }
mkdir "$tmp/empty"
"$weft" report "$tmp/empty" > "$tmp/err" 2>&1 && die "an empty directory was accepted"
grep -q "empty: not a weft run directory (no metrics.jsonl)" "$tmp/err" \
  || { cat "$tmp/err"; die "unclear error for a directory without metrics"; }
# A run killed before its first step finished: metrics.jsonl exists but is empty.
mkdir "$tmp/killed" && : > "$tmp/killed/metrics.jsonl"
"$weft" report "$tmp/killed" > "$tmp/err" 2>&1 && die "a run without steps was accepted"
grep -q "killed/metrics.jsonl: no steps recorded" "$tmp/err" \
  || { cat "$tmp/err"; die "unclear error for a run without steps"; }
# A plan.json or a simulation of the wrong shape names its file.
cp -r "$tmp/run" "$tmp/badplan" && echo '{"modules": 5}' > "$tmp/badplan/plan.json"
"$weft" report "$tmp/badplan" > "$tmp/err" 2>&1 && die "a bad plan.json was accepted"
grep -q "badplan/plan.json: not the plan" "$tmp/err" || { cat "$tmp/err"; die "unclear plan error"; }
echo '{"step_seconds": 1, "mfu": 0.5, "bubble_fraction": 0, "ranks": [{"rank": "x"}]}' \
  > "$tmp/badranks.json"
"$weft" report "$tmp/run" --sim "$tmp/badranks.json" > "$tmp/err" 2>&1 \
  && die "a simulation with bad ranks was accepted"
grep -q "badranks.json: ranks: expected" "$tmp/err" || { cat "$tmp/err"; die "unclear ranks error"; }
echo '{"step_seconds": -1, "mfu": 0.5, "bubble_fraction": 0, "ranks": []}' > "$tmp/negative.json"
"$weft" report "$tmp/negative.json" > "$tmp/err" 2>&1 && die "a negative step time was accepted"
grep -q "negative.json: step_seconds = -1: expected a number >= 0" "$tmp/err" \
  || { cat "$tmp/err"; die "unclear error for a negative step time"; }
echo '{"steps": 3}' > "$tmp/other.json"
"$weft" report "$tmp/other.json" > "$tmp/err" 2>&1 && die "a non-simulation JSON was accepted"
grep -q "other.json: step_seconds: missing" "$tmp/err" || { cat "$tmp/err"; die "unclear error"; }
echo "errors: $(grep -o 'error:.*' "$tmp/err")"
