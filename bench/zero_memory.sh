#!/usr/bin/env bash
# ZeRO-1's memory on this machine: small-vlm (~123M parameters, bf16) trained by 2 local ranks over
# Gloo, plain data parallelism against ZeRO-1 (train.zero_stage = 1: moments sharded, the sharded
# parameters held in bf16 with fp32 masters of each rank's shard only, as Megatron's distributed
# optimizer). Each rank's peak resident memory is measured (GNU time's maximum RSS), the two
# settings alternating, twice each; the saving is set against the one the planner's memory model
# predicts (`weft simulate`, per-rank static bytes) for the same two configs.
#   usage: bench/zero_memory.sh [BUILD_DIR] [STEPS]
set -euo pipefail
build=${1:-build}; steps=${2:-3}
src=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
config=$src/configs/small-vlm.toml
common=(--set train.steps=$steps --set train.warmup=1 --set train.threads=1
        --set train.checkpoint_every=0 --set data.eval_samples=0 --set train.log_every=1)

peak_kib() {  # zero stage, run name: the largest rank's maximum RSS in KiB
  "$build/weft" launch --nproc 2 -- /usr/bin/time -f "maxrss-kib %M" "$build/weft" train "$config" \
    "${common[@]}" --set train.zero_stage=$1 --out "$tmp/$2" --quiet > "$tmp/$2.log" 2>&1 ||
    { cat "$tmp/$2.log"; exit 1; }
  grep -o 'maxrss-kib [0-9]*' "$tmp/$2.log" | awk '$2 > m { m = $2 } END { print m }'
}
predicted_mib() {  # zero stage: the largest rank's static bytes in MiB, as the simulator holds them
  "$build/weft" simulate "$config" --cluster "$src/configs/clusters/cpu-local.toml" --world-size 2 \
    --set train.zero_stage=$1 2>/dev/null |
    python3 -c 'import json, sys; print(max(r["static_bytes"] for r in json.load(sys.stdin)["ranks"]) / 2**20)'
}

dp=(); zero=()
for round in 1 2; do
  dp+=("$(peak_kib 0 dp_$round)")
  zero+=("$(peak_kib 1 zero_$round)")
done
python3 - "${dp[*]}" "${zero[*]}" "$(predicted_mib 0)" "$(predicted_mib 1)" <<'EOF'
import sys
dp = [int(x) / 1024 for x in sys.argv[1].split()]
zero = [int(x) / 1024 for x in sys.argv[2].split()]
pred_dp, pred_zero = float(sys.argv[3]), float(sys.argv[4])
m_dp, m_zero = min(dp), min(zero)
print(f"peak RSS per rank (MiB, each round): DP2 {' '.join(f'{x:.0f}' for x in dp)}  "
      f"ZeRO-1 {' '.join(f'{x:.0f}' for x in zero)}")
print(f"ZeRO-1 / DP2 peak RSS per rank: {m_zero / m_dp:.3f} (saved {m_dp - m_zero:.0f} MiB)")
print(f"predicted static memory per rank (weft simulate): DP2 {pred_dp:.0f} MiB, ZeRO-1 "
      f"{pred_zero:.0f} MiB, saving {pred_dp - pred_zero:.0f} MiB")
print(f"measured saving / predicted saving: {(m_dp - m_zero) / (pred_dp - pred_zero):.3f}")
EOF
