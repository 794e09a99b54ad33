#!/usr/bin/env bash
# The real binary end to end: a short run writes its run directory; a run killed with SIGKILL
# mid-training leaves its last checkpoint loadable, and --resume finishes the run from it.
set -u
weft=$1; src=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"; [ $pid -gt 0 ] && kill -9 $pid 2>/dev/null' EXIT
pid=0
small=(--set model.llm.layers=1 --set model.vision.layers=1 --set data.eval_samples=32)
die() { echo "FAIL: $*"; exit 1; }

"$weft" train "$src/configs/tiny-vlm.toml" "${small[@]}" --set train.steps=4 --set train.warmup=1 \
  --out "$tmp/short" > "$tmp/short.log" 2>&1 || { cat "$tmp/short.log"; die "short run failed"; }
grep -q "run directory: $tmp/short" "$tmp/short.log" || die "run directory not printed"
for key in steps loss_first loss_last eval_caption_accuracy tokens_per_second mfu wall_seconds; do
  grep -q "\"$key\"" "$tmp/short/summary.json" || die "summary.json lacks $key"
done
[ "$(wc -l < "$tmp/short/metrics.jsonl")" -eq 4 ] || die "metrics.jsonl should have 4 lines"
[ -f "$tmp/short/checkpoints/step_00000004/rank-00000.safetensors" ] || die "no final checkpoint"

# Long run, killed once its second checkpoint exists.
"$weft" train "$src/configs/tiny-vlm.toml" "${small[@]}" --set train.steps=400 \
  --set train.checkpoint_every=3 --out "$tmp/long" > "$tmp/long.log" 2>&1 &
pid=$!
for _ in $(seq 600); do
  [ -f "$tmp/long/checkpoints/step_00000006/state.json" ] && break
  kill -0 $pid 2>/dev/null || { cat "$tmp/long.log"; die "training exited early"; }
  sleep 0.1
done
kill -9 $pid; wait $pid 2>/dev/null
echo "killed after $(ls "$tmp/long/checkpoints")"
"$weft" train --resume "$tmp/long" "${small[@]}" --set train.steps=12 --set train.warmup=1 > "$tmp/resume.log" 2>&1 \
  || { cat "$tmp/resume.log"; die "resume failed"; }
grep -q '"resumed_from_step": [1-9]' "$tmp/long/summary.json" || die "summary does not show the resume"
[ "$(wc -l < "$tmp/long/metrics.jsonl")" -eq 12 ] || die "metrics.jsonl should have 12 lines"
echo "kill -9 and resume: ok"
