#!/usr/bin/env bash
# `weft launch` with real processes over c10d/Gloo: a DP2 run matches the single-process losses,
# and a rank killed with SIGKILL mid-training ends the whole job quickly, naming that rank.
set -u
weft=$1; src=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"; [ $lpid -gt 0 ] && kill -9 $lpid 2>/dev/null' EXIT
lpid=0
die() { echo "FAIL: $*"; exit 1; }
small=(--set model.llm.layers=1 --set model.vision.layers=1 --set data.eval_samples=16
       --set train.precision=fp32 --set train.steps=3 --set train.warmup=1 --set train.batch=8)

"$weft" train "$src/configs/tiny-vlm.toml" "${small[@]}" --out "$tmp/single" --quiet \
  || die "single-process run failed"
# Without --out, in a directory of its own: both ranks use rank 0's fresh run directory (runs/
# <time>), where --trace-ops has each rank write its operators in step output.trace_step.
mkdir "$tmp/work"
(cd "$tmp/work" && "$weft" launch --nproc 2 -- "$weft" train "$src/configs/tiny-vlm.toml" \
  "${small[@]}" --set output.trace_step=2 --trace-ops) > "$tmp/dp2.log" 2>&1 \
  || { cat "$tmp/dp2.log"; die "DP2 launch failed"; }
[ "$(ls "$tmp/work/runs" | wc -l)" = 1 ] || { ls -R "$tmp/work/runs"; die "DP2 made more than one run directory"; }
mv "$tmp/work/runs"/* "$tmp/dp2"
grep -q '^\[rank 1\]' "$tmp/dp2.log" || { cat "$tmp/dp2.log"; die "rank 1 output not prefixed"; }
grep -q '"world_size": 2' "$tmp/dp2/summary.json" || die "summary does not record world_size 2"
python3 - "$tmp/dp2" <<'PY' || die "ops.rank<N>.json missing or incomplete"
import json, sys
spans = {e["name"] for e in json.load(open(f"{sys.argv[1]}/trace.json"))}  # the step's ops
for r in (0, 1):
    t = json.load(open(f"{sys.argv[1]}/ops.rank{r}.json"))["traceEvents"]
    names = {e["name"] for e in t}
    assert "aten::mm" in names and any(n.startswith("gloo:") for n in names), sorted(names)[:20]
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in t)
    # The step's ops, as trace.json names them, and weft's own are ranges around LibTorch's
    # operators; Gloo's collectives are in flight beside the others, apart from the nesting.
    assert "llm fwd mb0 s0" in names and "weft::rms_norm" in names, sorted(names)[:20]
    for e in t:
        want = ("async" if e["name"].startswith("gloo:") else
                "user_annotation" if e["name"] in spans else "cpu_op")
        assert e["cat"] == want, e
    print(f"rank {r}: {len(t)} operators in step 2")
PY
"$weft" train "$src/configs/tiny-vlm.toml" --set output.trace_step=0 --trace-ops \
  > "$tmp/noop.log" 2>&1 && die "--trace-ops without a traced step was accepted"
grep -q "trace_step" "$tmp/noop.log" || { cat "$tmp/noop.log"; die "--trace-ops error does not name output.trace_step"; }
# Each of the 2 local ranks takes half of the cores it may run on (at least 1), not all of them.
share=$(( $(nproc) / 2 )); [ "$share" -ge 1 ] || share=1
grep -q "\"threads\": $share\b" "$tmp/dp2/summary.json" \
  || { grep threads "$tmp/dp2/summary.json"; die "DP2 ranks do not use $share threads each"; }
python3 "$src/tests/cli/lib/same_losses.py" "$tmp/single/metrics.jsonl" "$tmp/dp2/metrics.jsonl" \
  3 "DP2" || die "DP2 losses differ"

# A long DP2 run; kill -9 rank 1 once training is under way.
"$weft" launch --nproc 2 -- "$weft" train "$src/configs/tiny-vlm.toml" --set train.steps=100000 \
  --out "$tmp/kill" > "$tmp/kill.log" 2>&1 &
lpid=$!
for _ in $(seq 300); do
  [ -s "$tmp/kill/metrics.jsonl" ] && break
  sleep 0.2
done
[ -s "$tmp/kill/metrics.jsonl" ] || { cat "$tmp/kill.log"; die "training did not start"; }
victim=$(pgrep -f -- "weft train .*--out $tmp/kill" | while read p; do
  grep -qz '^RANK=1$' /proc/$p/environ 2>/dev/null && echo $p; done | head -1)
[ -n "$victim" ] || die "could not find rank 1"
start=$(date +%s)
kill -9 "$victim"
wait $lpid; rc=$?
elapsed=$(( $(date +%s) - start ))
[ $rc -ne 0 ] || die "launch exited 0 after a rank was killed"
[ $elapsed -le 10 ] || die "job took ${elapsed}s to stop (limit 10 s)"
grep -q "rank 1 was killed by signal 9" "$tmp/kill.log" || { tail -5 "$tmp/kill.log"; die "message does not name rank 1"; }
sleep 0.5
pgrep -f -- "--out $tmp/kill" >/dev/null && die "orphan ranks left behind"
echo "killed rank 1: job ended in ${elapsed}s: $(grep 'weft launch: error' "$tmp/kill.log")"

# --max-restarts: kill -9 rank 1 after the first checkpoint; the launcher starts the job again,
# training resumes from that checkpoint and finishes; metrics record the restart.
"$weft" launch --nproc 2 --max-restarts 1 -- "$weft" train "$src/configs/tiny-vlm.toml" \
  "${small[@]}" --set train.steps=300 --set train.checkpoint_every=20 --set train.threads=1 \
  --out "$tmp/restart" > "$tmp/restart.log" 2>&1 &
lpid=$!
for _ in $(seq 300); do
  [ -d "$tmp/restart/checkpoints/step_00000020" ] && break
  sleep 0.1
done
victim=$(pgrep -f -- "weft train .*--out $tmp/restart" | while read p; do
  grep -qz '^RANK=1$' /proc/$p/environ 2>/dev/null && echo $p; done | head -1)
[ -n "$victim" ] || { cat "$tmp/restart.log"; die "restart: could not find rank 1"; }
kill -9 "$victim"
wait $lpid || { tail -20 "$tmp/restart.log"; die "restart: the job did not finish after a restart"; }
lpid=0
grep -q "restart 1 of 1" "$tmp/restart.log" || die "restart: no restart message"
python3 - "$tmp/restart" <<'PY' || die "restart: metrics do not show one complete run with the restart"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
assert [r["step"] for r in rows] == list(range(1, 301)), [r["step"] for r in rows][:40]
marked = [r["step"] for r in rows if r.get("restart") == 1]
assert len(marked) == 1 and marked[0] > 20 and (marked[0] - 1) % 20 == 0, marked
s = json.load(open(sys.argv[1] + "/summary.json"))
assert s["restarts"] == 1 and s["steps"] == 300, s
print("restarted once, resumed at step", marked[0], "and finished 300 steps")
PY

# A rank that never arrives: rank 0 of 2 alone ends with a clear timeout error, not a hang.
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
start=$(date +%s)
RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 60 \
  "$weft" train "$src/configs/tiny-vlm.toml" --timeout 3 --out "$tmp/alone" > "$tmp/alone.log" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
[ $rc -ne 0 ] && [ $rc -ne 124 ] || { cat "$tmp/alone.log"; die "lone rank: exit $rc (124 = hung)"; }
grep -q "only 1 of 2 ranks arrived" "$tmp/alone.log" || { cat "$tmp/alone.log"; die "no rendezvous timeout message"; }
echo "lone rank ended after ${elapsed}s: $(grep -o 'only 1 of 2.*' "$tmp/alone.log" | head -1)"
