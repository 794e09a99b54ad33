#!/usr/bin/env bash
# configs/llava-style.toml end to end with the real binary: `weft example llava` writes a
# LLaVA JSON dataset (PNG images), a tokenizer.json and HF-layout Llama + CLIP checkpoints;
# training starts from those checkpoints and lowers the loss; `weft export` writes the trained
# model back in HF layout, and a run started from the export begins where the first one ended.
set -u
weft=$1; src=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
die() { echo "FAIL: $*"; exit 1; }

"$weft" example llava "$tmp/ex" --samples 200 > /dev/null || die "weft example llava failed"
[ "$(ls "$tmp/ex/images" | wc -l)" -eq 200 ] || die "expected 200 images"
paths=(--set model.llm.hf="$tmp/ex/llm" --set model.vision.hf="$tmp/ex/vision"
       --set data.path="$tmp/ex/data.json" --set data.tokenizer="$tmp/ex/tokenizer.json"
       --set data.eval_samples=8 --set train.batch=16 --set train.warmup=5)
"$weft" train "$src/configs/llava-style.toml" "${paths[@]}" --set train.steps=40 \
  --set train.checkpoint_every=40 --out "$tmp/run" --quiet > "$tmp/run.log" 2>&1 ||
  { cat "$tmp/run.log"; die "training failed"; }

"$weft" export "$tmp/run" --hf "$tmp/hf" --dtype bf16 > "$tmp/export.log" 2>&1 ||
  { cat "$tmp/export.log"; die "export failed"; }
for f in llm/config.json llm/model.safetensors vision/config.json vision/model.safetensors; do
  [ -f "$tmp/hf/$f" ] || die "export wrote no $f"
done

# A config.toml edited after the run (one LLM block fewer) no longer describes the checkpoint:
# export names the tensor it cannot place and writes nothing.
cp -r "$tmp/run" "$tmp/edited"
python3 - "$tmp/edited/config.toml" <<'PY' || die "could not edit the config"
import re, sys
text = open(sys.argv[1]).read()
text = re.sub(r'(?m)^hf = .*\n', '', text)  # the shapes from config.toml itself
llm = text.index("[model.llm]")
m = re.compile(r'(?m)^layers = (\d+)').search(text, llm)
text = text[:m.start()] + "layers = %d" % (int(m.group(1)) - 1) + text[m.end():]
open(sys.argv[1], "w").write(text)
PY
"$weft" export "$tmp/edited" --hf "$tmp/hf-edited" > "$tmp/err" 2>&1 && die "a stale config exported"
grep -q "is not part of the model of .*config.toml (a checkpoint of another model, or a config changed after it was written?)" \
  "$tmp/err" || { cat "$tmp/err"; die "unclear error for a stale config"; }
[ ! -e "$tmp/hf-edited" ] || die "a failed export left files behind"

# Start again from the exported (bf16) weights: the first loss is the trained model's.
"$weft" train "$src/configs/llava-style.toml" "${paths[@]}" --set model.llm.hf="$tmp/hf/llm" \
  --set model.vision.hf="$tmp/hf/vision" --set train.steps=6 --out "$tmp/again" --quiet \
  > "$tmp/again.log" 2>&1 || { cat "$tmp/again.log"; die "training from the export failed"; }

python3 - "$tmp/run/metrics.jsonl" "$tmp/again/metrics.jsonl" <<'PY' || die "losses"
import json, sys
run = [json.loads(l)["loss"] for l in open(sys.argv[1])]
again = [json.loads(l)["loss"] for l in open(sys.argv[2])]
assert len(run) == 40, len(run)
first, last = sum(run[:3]) / 3, sum(run[-3:]) / 3
assert last < 0.6 * first, ("loss did not fall", run)
assert again[0] < 0.75 * run[0], ("the export did not carry the training", run[0], again[0])
print("llava-style: loss", round(first, 3), "->", round(last, 3), "; from the export", round(again[0], 3))
PY
