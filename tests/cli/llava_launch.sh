#!/usr/bin/env bash
# LLaVA-style data over real processes: each rank decodes only the images its encoder stage
# reads, and under data.on_error = "skip" a corrupt image found by one rank is replaced on every
# rank, so DP2, a separate placement and packed rows split over encoder ranks still match one
# process's losses, skipping the same records.
set -u
weft=$1; src=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
die() { echo "FAIL: $*"; exit 1; }

"$weft" example llava "$tmp/ex" --samples 64 > /dev/null || die "weft example llava failed"
# Ten of the 56 training records get a corrupt image (only one rank decodes each).
for i in 03 07 11 17 23 29 31 37 41 47; do printf 'not a png' > "$tmp/ex/images/0000$i.png"; done
run=(--set model.llm.hf="$tmp/ex/llm" --set model.vision.hf="$tmp/ex/vision"
     --set data.path="$tmp/ex/data.json" --set data.tokenizer="$tmp/ex/tokenizer.json"
     --set data.eval_samples=8 --set data.on_error=skip --set train.batch=16 --set train.steps=3
     --set train.warmup=1 --set train.log_every=1 --set train.precision=fp32)
cfg="$src/configs/llava-style.toml"

"$weft" train "$cfg" "${run[@]}" --out "$tmp/single" --quiet > "$tmp/single.log" 2>&1 ||
  { cat "$tmp/single.log"; die "single-process run failed"; }
"$weft" launch --nproc 2 -- "$weft" train "$cfg" "${run[@]}" --out "$tmp/dp2" \
  > "$tmp/dp2.log" 2>&1 || { cat "$tmp/dp2.log"; die "DP2 launch failed"; }
"$weft" launch --nproc 2 -- "$weft" train "$cfg" "${run[@]}" \
  --set parallel.placement='"separate"' --out "$tmp/sep" > "$tmp/sep.log" 2>&1 ||
  { cat "$tmp/sep.log"; die "separate-placement launch failed"; }

# Packed rows put items in row order, not sample order; encoder DP 2 against LLM DP 1 splits one
# replica's items between two ranks, so each must load exactly the collated range it reads.
packed=(--set data.packing=true --set model.llm.max_seq=180)
"$weft" train "$cfg" "${run[@]}" "${packed[@]}" --out "$tmp/packed1" --quiet \
  > "$tmp/packed1.log" 2>&1 || { cat "$tmp/packed1.log"; die "packed single-process run failed"; }
"$weft" launch --nproc 2 -- "$weft" train "$cfg" "${run[@]}" "${packed[@]}" \
  --set parallel.llm.tp=2 --set parallel.vision.dp=2 --out "$tmp/packed2" \
  > "$tmp/packed2.log" 2>&1 || { cat "$tmp/packed2.log"; die "packed encoder-DP2 launch failed"; }

# Under "fail" the rank that decodes a corrupt image and the ranks that did not all stop.
if "$weft" launch --nproc 2 -- "$weft" train "$cfg" "${run[@]}" --set data.on_error=fail \
  --out "$tmp/fail" > "$tmp/fail.log" 2>&1; then die "a corrupt image did not stop the run"; fi
grep -q 'data.json: record [0-9]*: .*images/0000[0-9]*.png' "$tmp/fail.log" ||
  { cat "$tmp/fail.log"; die "the error does not name the record and file"; }

lib="$src/tests/cli/lib/same_losses.py"
python3 "$lib" "$tmp/packed1/metrics.jsonl" "$tmp/packed2/metrics.jsonl" 3 "llava packed" ||
  die "packed losses differ"
python3 "$lib" "$tmp/single/metrics.jsonl" "$tmp/dp2/metrics.jsonl" 3 "llava DP2" ||
  die "DP2 losses differ"
python3 "$lib" "$tmp/single/metrics.jsonl" "$tmp/sep/metrics.jsonl" 3 "llava separate" ||
  die "separate-placement losses differ"
python3 - "$tmp/single/metrics.jsonl" "$tmp/dp2/metrics.jsonl" "$tmp/sep/metrics.jsonl" <<'PY' ||
import json, sys
skipped = [[json.loads(l).get("data_skipped", 0) for l in open(p)] for p in sys.argv[1:]]
assert skipped[0][-1] > 0, ("no corrupt image was met", skipped)
assert skipped[0] == skipped[1] == skipped[2], ("the runs skipped differently", skipped)
print("records skipped per step, all runs:", skipped[0])
PY
  die "skipped records differ"
