#!/usr/bin/env bash
# ZeRO-1's memory on this machine: small-vlm (~123M parameters, bf16) trained by 2 local ranks over
# Gloo, plain data parallelism against ZeRO-1 (train.zero_stage = 1: moments sharded, the sharded
# parameters held in bf16 with fp32 masters of each rank's shard only, as Megatron's distributed
# optimizer). Measured per setting, the two alternating, twice each:
#  - the training steps' peak: rank 0's peak resident set after the last step (metrics.jsonl
#    peak_memory_mib, written before the final checkpoint);
#  - the whole run's peak, the final checkpoint and evaluation included: the largest rank's
#    maximum resident set (GNU time).
# The steps' saving is set against the one the planner's memory model predicts (`weft simulate`,
# per-rank static bytes) for the same two configs. Then each setting's last run is resumed for one
# more step (`weft train --resume`): the resumed run's peak against the fresh run's shows what
# loading the checkpoint costs (each rank reads its own shards and pieces, not the model).
#   usage: bench/zero_memory.sh [BUILD_DIR] [STEPS]
set -euo pipefail
build=${1:-build}; steps=${2:-4}
src=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
config=$src/configs/small-vlm.toml
common=(--set train.steps=$steps --set train.warmup=1 --set train.threads=1
        --set train.checkpoint_every=0 --set data.eval_samples=4 --set train.log_every=1)

run() {  # zero stage, run name[, resume]: prints "steps-peak-MiB run-peak-MiB"
  local what=("$config" "${common[@]}" --set train.zero_stage=$1 --out "$tmp/$2")
  [[ ${3:-} == resume ]] && what=(--resume "$tmp/$2" "${common[@]}" --set train.steps=$((steps + 1)))
  "$build/weft" launch --nproc 2 -- /usr/bin/time -f "maxrss-kib %M" "$build/weft" train \
    "${what[@]}" --quiet > "$tmp/$2.log" 2>&1 || { cat "$tmp/$2.log" >&2; exit 1; }
  python3 - "$tmp/$2/metrics.jsonl" "$tmp/$2.log" <<'EOF'
import json, re, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rss = [int(k) for k in re.findall(r"maxrss-kib (\d+)", open(sys.argv[2]).read())]
print(f"{steps[-1]['peak_memory_mib']:.1f} {max(rss) / 1024:.1f}")
EOF
}
predicted_mib() {  # zero stage: the largest rank's static bytes in MiB, as the simulator holds them
  "$build/weft" simulate "$config" --cluster "$src/configs/clusters/cpu-local.toml" --world-size 2 \
    --set train.zero_stage=$1 2>/dev/null |
    python3 -c 'import json, sys; print(max(r["static_bytes"] for r in json.load(sys.stdin)["ranks"]) / 2**20)'
}

results=()
for round in 1 2; do
  results+=("dp $(run 0 dp_$round)" "zero $(run 1 zero_$round)")
done
results+=("dp_resumed $(run 0 dp_2 resume)" "zero_resumed $(run 1 zero_2 resume)")
python3 - "$(predicted_mib 0)" "$(predicted_mib 1)" "${results[@]}" <<'EOF'
import sys
runs = {"dp": [], "zero": [], "dp_resumed": [], "zero_resumed": []}
for line in sys.argv[3:]:
    kind, steps, whole = line.split()
    runs[kind].append((float(steps), float(whole)))
pred_dp, pred_zero = float(sys.argv[1]), float(sys.argv[2])
dp_steps, zero_steps = min(s for s, _ in runs["dp"]), min(s for s, _ in runs["zero"])
dp_whole, zero_whole = min(w for _, w in runs["dp"]), min(w for _, w in runs["zero"])
fmt = lambda xs: " ".join(f"{x:.0f}" for x in xs)
print("peak resident memory, MiB (each round):")
print(f"  training steps (rank 0):          DP2 {fmt(s for s, _ in runs['dp'])}   "
      f"ZeRO-1 {fmt(s for s, _ in runs['zero'])}")
print(f"  whole run, checkpoint included:   DP2 {fmt(w for _, w in runs['dp'])}   "
      f"ZeRO-1 {fmt(w for _, w in runs['zero'])}")
print(f"ZeRO-1 / DP2, training steps: {zero_steps / dp_steps:.3f} (saved {dp_steps - zero_steps:.0f} MiB per rank)")
print(f"ZeRO-1 / DP2, whole run: {zero_whole / dp_whole:.3f}")
print(f"predicted static memory per rank (weft simulate): DP2 {pred_dp:.0f} MiB, ZeRO-1 "
      f"{pred_zero:.0f} MiB, saving {pred_dp - pred_zero:.0f} MiB")
print(f"measured saving in the steps / predicted saving: "
      f"{(dp_steps - zero_steps) / (pred_dp - pred_zero):.3f}")
for kind, name in (("dp", "DP2"), ("zero", "ZeRO-1")):
    fresh, resumed = runs[kind][-1][1], runs[kind + "_resumed"][0][1]
    print(f"{name} resumed for one step / its fresh run, whole run: {resumed / fresh:.3f} "
          f"({resumed:.0f} MiB against {fresh:.0f})")
EOF
