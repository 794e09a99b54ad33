#!/usr/bin/env bash
# Bad input through the real binary: each case must exit non-zero with a message that names
# the file / key and what was expected — never a crash.
set -u
weft=$1; src=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fail=0
expect_error() {  # name, expected substring, command...
  local name=$1 want=$2; shift 2
  local out rc
  out=$("$@" 2>&1); rc=$?
  if [ $rc -eq 0 ] || [ $rc -ge 128 ]; then
    echo "FAIL $name: exit status $rc (want a clean non-zero exit)"; echo "$out"; fail=1
  elif ! grep -qF -- "$want" <<<"$out"; then
    echo "FAIL $name: message lacks '$want':"; echo "$out"; fail=1
  else
    echo "ok   $name: $(grep -F -- "$want" <<<"$out" | head -1)"
  fi
}
printf '[model.llm]\nhidden = = 3\n' > "$tmp/malformed.toml"
expect_error malformed-toml "malformed.toml: invalid TOML at line 2" "$weft" train "$tmp/malformed.toml"
expect_error missing-file "$tmp/nope.toml" "$weft" train "$tmp/nope.toml"
expect_error unknown-key "train.stepz" "$weft" train "$src/configs/tiny-vlm.toml" --set train.stepz=3
expect_error bad-set "expected section.key=value" "$weft" train "$src/configs/tiny-vlm.toml" --set steps
expect_error wrong-type "train.steps" "$weft" train "$src/configs/tiny-vlm.toml" --set 'train.steps="many"'
expect_error heads "model.llm.heads" "$weft" train "$src/configs/tiny-vlm.toml" --set model.llm.heads=3
expect_error layout "parallel.llm" "$weft" train "$src/configs/tiny-vlm.toml" --set parallel.llm.tp=2
expect_error synthetic-vocab "tiny-vlm.toml: model.llm.vocab = 0: must be set (> 0)" "$weft" train "$src/configs/tiny-vlm.toml" --set data.kind=synthetic
expect_error synthetic-seq-len "data.seq_len = 128 is larger than model.llm.max_seq = 64" "$weft" train "$src/configs/tiny-vlm.toml" --set data.kind=synthetic --set model.llm.vocab=512 --set data.seq_len=128
expect_error synthetic-images "data.images = 4 x (vision 16) placeholder tokens = 64" "$weft" train "$src/configs/tiny-vlm.toml" --set data.kind=synthetic --set model.llm.vocab=512 --set data.images=4
expect_error device-name 'train.device = "gpu": must be one of "cpu", "cuda"' "$weft" train "$src/configs/tiny-vlm.toml" --set train.device=gpu
# A CPU-only build asked for CUDA says so (a CUDA build on a machine without a GPU: no device).
if ! "$weft" version | grep -q "devices: cpu cuda"; then
  expect_error device-cuda 'train.device = "cuda": this weft is built against a CPU-only LibTorch' "$weft" train "$src/configs/tiny-vlm.toml" --set train.device=cuda
fi
expect_error resume-empty "not a weft run directory (no config.toml)" "$weft" train --resume "$tmp"
mkdir -p "$tmp/run" && cp "$src/configs/tiny-vlm.toml" "$tmp/run/config.toml"
expect_error resume-nothing "no complete checkpoint" "$weft" train --resume "$tmp/run"
expect_error resume-missing "not a run directory" "$weft" train --resume "$tmp/none"
out=$("$weft" plan "$src/configs/tiny-vlm.toml") || { echo "FAIL plan: exit $?"; fail=1; }
grep -q '"name": "vision.projector"' <<<"$out" || { echo "FAIL plan output: $out"; fail=1; }
out=$("$weft" inspect cp-split --length 1000 --span 10:266 --span 600:856 --cp 4) \
  || { echo "FAIL inspect cp-split: exit $?"; fail=1; }
for p in contiguous zigzag lpt balanced; do
  grep -q "\"$p\"" <<<"$out" || { echo "FAIL inspect cp-split lacks $p"; fail=1; }
done
expect_error cp-split-span "--span 5-9: expected BEGIN:END" "$weft" inspect cp-split --length 100 --span 5-9
expect_error cp-split-overlap "overlap" "$weft" inspect cp-split --length 100 --span 5:20 --span 10:30
expect_error threads "train.threads = 100000: must be at most 1024" "$weft" train "$src/configs/tiny-vlm.toml" --set train.threads=100000
expect_error sp-without-tp "parallel.llm.sp = true: sequence parallelism splits the tokens over the tensor-parallel ranks, so it needs tp > 1" "$weft" plan "$src/configs/tiny-vlm.toml" --set parallel.llm.sp=true
expect_error out-over-a-run "run: already holds a run (config.toml); continue it with \`weft train --resume" "$weft" train "$src/configs/tiny-vlm.toml" --out "$tmp/run"
# Under `weft launch --max-restarts` the refusal is not restarted (a restart would skip it).
expect_error out-over-a-run-launch "weft launch: not restarted: the input is at fault" "$weft" launch --nproc 1 --max-restarts 2 -- "$weft" train "$src/configs/tiny-vlm.toml" --out "$tmp/run"
cmp -s "$src/configs/tiny-vlm.toml" "$tmp/run/config.toml" || { echo "FAIL the refused run's directory changed"; fail=1; }
expect_error world-size-zero "--world-size: must be > 0, got 0" "$weft" plan "$src/configs/tiny-vlm.toml" --world-size 0
expect_error world-size-text "--world-size: expected a number, got '2x'" "$weft" plan "$src/configs/tiny-vlm.toml" --world-size 2x
expect_error balance-batch "--batch: must be > 0, got 0" "$weft" inspect balance "$src/configs/tiny-vlm.toml" --batch 0
expect_error master-port "--master-port: must be in 0..65535, got 99999" "$weft" launch --nproc 1 --master-port 99999 -- true
# The FLOP model prices the data's mean sample: unreadable data names the file and says how to
# plan without it (--full-rows), which then plans; `weft plan` (no --cluster) as well where it cuts.
nodata=(--set 'data.kind="llava"' --set "data.path=$tmp/none.json" --set "data.tokenizer=$tmp/none-tok.json")
expect_error plan-no-data "none-tok.json (reading the dataset for the data's mean sample, which the FLOP model prices; --full-rows prices max_seq rows instead" "$weft" plan "$src/configs/tiny-vlm.toml" --cluster "$src/configs/clusters/cpu-local.toml" "${nodata[@]}"
"$weft" plan "$src/configs/tiny-vlm.toml" --cluster "$src/configs/clusters/cpu-local.toml" "${nodata[@]}" --full-rows > /dev/null \
  || { echo "FAIL plan --full-rows without the data"; fail=1; }
expect_error simulate-no-data "--full-rows prices max_seq rows instead" "$weft" simulate "$src/configs/tiny-vlm.toml" --cluster "$src/configs/clusters/cpu-local.toml" "${nodata[@]}"
expect_error plan-cut-no-data "--full-rows prices max_seq rows instead" "$weft" plan "$src/configs/tiny-vlm.toml" --world-size 2 --set parallel.llm.pp=2 "${nodata[@]}"
"$weft" plan "$src/configs/tiny-vlm.toml" "${nodata[@]}" > /dev/null \
  || { echo "FAIL plan without a cut read the data"; fail=1; }
[ $fail -eq 0 ] && echo "all CLI error cases passed"
exit $fail
