#!/usr/bin/env bash
# Soak: a 2-rank data-parallel fp32 run of tiny-vlm (1 layer per module) is killed with SIGKILL
# -- a random rank at a random moment -- CYCLES times; `weft launch --max-restarts` restarts it
# from the last checkpoint each time. Checks: the run finishes, metrics.jsonl has every step
# exactly once, the losses equal an uninterrupted run's (fp32 resume is exact), the metrics
# record every restart, and the ranks' resident memory does not grow from cycle to cycle.
# Usage: bench/soak.sh [BUILD_DIR] [CYCLES]   (default build, 10)
set -u
cd "$(dirname "$0")/.."
weft=${1:-build}/weft; cycles=${2:-10}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
steps=$((cycles * 150 + 30))
args=(--set model.llm.layers=1 --set model.vision.layers=1 --set data.eval_samples=16
      --set train.precision=fp32 --set train.steps=$steps --set train.checkpoint_every=5
      --set train.threads=1 --set train.warmup=5 --set train.log_every=1000)

"$weft" launch --nproc 2 -- "$weft" train configs/tiny-vlm.toml "${args[@]}" --out "$tmp/ref" \
  --quiet > "$tmp/ref.log" 2>&1 || { tail "$tmp/ref.log"; echo "FAIL: reference run"; exit 1; }

"$weft" launch --nproc 2 --max-restarts $cycles -- "$weft" train configs/tiny-vlm.toml \
  "${args[@]}" --out "$tmp/soak" --quiet > "$tmp/soak.log" 2>&1 &
lpid=$!
: > "$tmp/rss"
for cycle in $(seq 1 "$cycles"); do
  sleep "$(python3 -c "import random; print(round(random.uniform(3, 8), 1))")"
  kill -0 $lpid 2>/dev/null || break
  for p in $(pgrep -f -- "weft train .*--out $tmp/soak"); do  # ranks' RSS before the kill
    echo "$cycle $(awk '/VmRSS/ {print $2}' /proc/$p/status 2>/dev/null)" >> "$tmp/rss"
  done
  rank=$((RANDOM % 2))
  victim=$(pgrep -f -- "weft train .*--out $tmp/soak" | while read -r p; do
    grep -qz "^RANK=$rank\$" /proc/$p/environ 2>/dev/null && echo $p; done | head -1)
  [ -n "$victim" ] && kill -9 "$victim" && echo "cycle $cycle: killed rank $rank"
  # wait until the restarted job is training again (its ranks exist)
  for _ in $(seq 200); do
    [ "$(pgrep -f -- "weft train .*--out $tmp/soak" | wc -l)" -ge 2 ] && break; sleep 0.1
  done
done
wait $lpid; rc=$?
[ $rc -eq 0 ] || { tail -20 "$tmp/soak.log"; echo "FAIL: the soaked job did not finish"; exit 1; }
python3 - "$tmp" "$steps" <<'PY'
import json, sys, collections
tmp, steps = sys.argv[1], int(sys.argv[2])
ref = [json.loads(l) for l in open(tmp + "/ref/metrics.jsonl")]
soak = [json.loads(l) for l in open(tmp + "/soak/metrics.jsonl")]
assert [r["step"] for r in soak] == list(range(1, steps + 1)), "lost or repeated steps"
diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(ref, soak))
restarts = [r["restart"] for r in soak if "restart" in r]
rss = collections.defaultdict(list)
for line in open(tmp + "/rss"):
    c, kb = line.split()[:2] if len(line.split()) > 1 else (line.split()[0], "0")
    if int(kb) > 0: rss[int(c)].append(int(kb))
peaks = [max(v) / 1024 for _, v in sorted(rss.items())]
print(f"steps {steps}, restarts recorded {len(restarts)} (last {restarts[-1] if restarts else 0}), "
      f"max |loss - uninterrupted| {diff:.3g}")
print("rank RSS per cycle (MiB, before each kill):", " ".join(f"{p:.0f}" for p in peaks))
assert diff == 0.0, "losses differ from the uninterrupted run"
assert restarts, "no restart recorded"
half = len(peaks) // 2
if half:
    grow = (sum(peaks[half:]) / len(peaks[half:])) / (sum(peaks[:half]) / half)
    print(f"late/early mean RSS {grow:.3f}")
    assert grow < 1.1, "resident memory grows across restarts"
print("soak: PASS")
PY
