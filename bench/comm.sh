#!/usr/bin/env bash
# Communication on this machine, for tiny-vlm on 2 local ranks over Gloo (one intra-op thread
# each):
#  - DP2: the fraction of step time spent in exposed gradient reduction, and how much of it the
#    overlap with backward hides;
#  - PP2 (LLM in two pipeline stages, vision encoder data-parallel over both ranks, 4
#    microbatches, 1F1B): the fraction of step time spent blocked in point-to-point receives
#    (transfers plus pipeline bubbles) and in exposed gradient reduction;
#  - LLM TP2, without and with SP: the time per step blocked in TP collectives and the step
#    time, with the column-parallel linears' backward overlapping its collectives with its matmuls
#    (train.overlap_tp_comm, the default) and waiting for each where issued; the two run
#    alternately, twice each, against drift;
#  - DP2 with and without ZeRO-1 (reduce-scatter, each rank steps its shard, all-gather), and
#    ZeRO-1 with the parameter all-gather overlapped with the next forward (the default) and
#    waited for after the optimizer step: the step time, the exposed gradient reduction, the
#    optimizer step and the time forward waited for parameters, alternately, twice each;
#  - the blocking collectives through shared memory (train.shared_memory_collectives, the
#    default) against Gloo's TCP loopback, for LLM TP2, TP2 + SP, TP2 + SP on the vision encoder
#    too, LLM CP2 and DP2: step time and time blocked in collectives, alternately, twice each,
#    with the losses of both compared;
#  - point-to-point messages through shared memory (train.shared_memory_messages, the default)
#    against Gloo's TCP loopback, the collectives through shared memory in both, for LLM PP2,
#    PP2 x VP2 (4 blocks, 2 chunks per rank) and the vision encoder and the LLM on separate ranks:
#    step time and time blocked in receives, alternately, twice each, the losses compared.
# The TP overlap runs keep their collectives on Gloo (train.shared_memory_collectives = false):
# through shared memory nothing overlaps.
# All runs happen here, in one invocation, so the ratios compare like with like.
#   usage: bench/comm.sh [BUILD_DIR] [STEPS] [BUCKET_MB]
set -euo pipefail
build=${1:-build}; steps=${2:-60}
src=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
bucket_mb=${3:-0.5}  # ~0.8M-parameter model: 0.5 MiB buckets give several buckets to overlap
common=(--set train.steps=$steps --set train.warmup=5 --set train.threads=1
        --set train.microbatches=2 --set train.checkpoint_every=0 --set data.eval_samples=16
        --set train.grad_bucket_mb=$bucket_mb)

run() {  # name, launch args...
  local name=$1; shift
  "$@" "$build/weft" train "$src/configs/tiny-vlm.toml" "${common[@]}" --out "$tmp/$name" \
    --quiet > "$tmp/$name.log" 2>&1 || { cat "$tmp/$name.log"; exit 1; }
}
run single env
run dp2_overlap "$build/weft" launch --nproc 2 --
"$build/weft" launch --nproc 2 -- "$build/weft" train "$src/configs/tiny-vlm.toml" "${common[@]}" \
  --set train.overlap_grad_reduce=false --out "$tmp/dp2_no_overlap" --quiet \
  > "$tmp/dp2_no_overlap.log" 2>&1 || { cat "$tmp/dp2_no_overlap.log"; exit 1; }

"$build/weft" launch --nproc 2 -- "$build/weft" train "$src/configs/tiny-vlm.toml" "${common[@]}" \
  --set train.microbatches=4 --set parallel.llm.pp=2 --out "$tmp/pp2" --quiet \
  > "$tmp/pp2.log" 2>&1 || { cat "$tmp/pp2.log"; exit 1; }

for round in 1 2; do
  for sp in false true; do
    for overlap in true false; do
      [ $round -eq 2 ] && overlap=$([ $overlap = true ] && echo false || echo true)
      name=tp2_sp${sp}_overlap${overlap}_$round
      "$build/weft" launch --nproc 2 -- "$build/weft" train "$src/configs/tiny-vlm.toml" \
        "${common[@]}" --set parallel.llm.tp=2 --set parallel.llm.sp=$sp \
        --set train.overlap_tp_comm=$overlap --set train.shared_memory_collectives=false \
        --out "$tmp/$name" --quiet \
        > "$tmp/$name.log" 2>&1 || { cat "$tmp/$name.log"; exit 1; }
    done
  done
done

for round in 1 2; do
  order="0 1 1w"; [ $round -eq 2 ] && order="1w 1 0"
  for zero in $order; do  # 1w: ZeRO-1, the parameter gather waited for after the optimizer
    name=dp2_zero${zero}_$round
    "$build/weft" launch --nproc 2 -- "$build/weft" train "$src/configs/tiny-vlm.toml" \
      "${common[@]}" --set train.zero_stage=${zero%w} \
      --set train.overlap_param_gather=$([ "$zero" = 1w ] && echo false || echo true) \
      --out "$tmp/$name" --quiet > "$tmp/$name.log" 2>&1 || { cat "$tmp/$name.log"; exit 1; }
  done
done

shm_layouts=(
  "tp2:parallel.llm.tp=2"
  "tp2sp:parallel.llm.tp=2 parallel.llm.sp=true"
  "tp2sp_both:parallel.llm.tp=2 parallel.llm.sp=true parallel.vision.tp=2 parallel.vision.sp=true"
  "cp2:parallel.llm.cp=2"
  "dp2:"
)
msg_layouts=(
  "pp2:train.microbatches=4 parallel.llm.pp=2"
  "pp2vp2:train.microbatches=4 model.llm.layers=4 parallel.llm.pp=2 parallel.llm.vp=2"
  "separate:train.microbatches=4 parallel.placement=separate"
)
# Each layout with `setting` true and false, alternating, twice: $tmp/PREFIX_LAYOUT_VALUE_ROUND.
ab_runs() {  # prefix, setting, layouts...
  local prefix=$1 setting=$2; shift 2
  for round in 1 2; do
    for layout in "$@"; do
      local sets=(); for kv in ${layout#*:}; do sets+=(--set "$kv"); done
      local order="true false"; [ $round -eq 2 ] && order="false true"
      for value in $order; do
        local name=${prefix}_${layout%%:*}_${value}_$round
        "$build/weft" launch --nproc 2 -- "$build/weft" train "$src/configs/tiny-vlm.toml" \
          "${common[@]}" "${sets[@]}" --set "$setting=$value" \
          --out "$tmp/$name" --quiet > "$tmp/$name.log" 2>&1 || { cat "$tmp/$name.log"; exit 1; }
      done
    done
  done
}
ab_runs shm train.shared_memory_collectives "${shm_layouts[@]}"
ab_runs msg train.shared_memory_messages "${msg_layouts[@]}"

python3 - "$tmp" "$steps" <<'PY'
import json, statistics, sys
tmp, steps = sys.argv[1], int(sys.argv[2])
def load(name):
    rows = [json.loads(l) for l in open(f"{tmp}/{name}/metrics.jsonl")]
    return rows[len(rows) // 5:]  # skip warm-up steps
def med(rows, key): return statistics.median(r[key] for r in rows)
single, on, off = load("single"), load("dp2_overlap"), load("dp2_no_overlap")
s_step, on_step, off_step = med(single, "step_seconds"), med(on, "step_seconds"), med(off, "step_seconds")
on_sync, off_sync = med(on, "grad_sync_seconds"), med(off, "grad_sync_seconds")
print(f"median step seconds: single {s_step:.4f}  DP2 overlap {on_step:.4f}  DP2 no-overlap {off_step:.4f}")
print(f"exposed gradient reduction per step: overlap {on_sync:.4f} s, no-overlap {off_sync:.4f} s")
print(f"fraction of DP2 step time in exposed gradient reduction: no-overlap {off_sync / off_step:.3f}, overlap {on_sync / on_step:.3f}")
print(f"share of the reduction hidden behind backward: {1 - on_sync / off_sync:.3f}")
print(f"buckets started during backward (overlap run, median): {med(on, 'grad_buckets_overlapped'):.0f}")
print(f"DP2 throughput vs single process (same global batch, 2 ranks on 2 cores): {s_step / on_step:.3f}x")
pp = load("pp2")
pp_step, pp_wait, pp_sync = med(pp, "step_seconds"), med(pp, "p2p_wait_seconds"), med(pp, "grad_sync_seconds")
print(f"PP2 (4 microbatches, 1F1B) median step seconds {pp_step:.4f}: "
      f"blocked in p2p receives {pp_wait / pp_step:.3f} of the step (transfers + bubbles), "
      f"exposed gradient reduction {pp_sync / pp_step:.3f}")
print(f"PP2 throughput vs single process: {s_step / pp_step:.3f}x; "
      f"textbook 1F1B bubble for p=2, m=4: {1 / 5:.3f}")
for sp in ("false", "true"):
    def both(overlap, key):  # the mean of the two rounds' medians
        return statistics.mean(med(load(f"tp2_sp{sp}_overlap{overlap}_{r}"), key) for r in (1, 2))
    on_step, off_step = both("true", "step_seconds"), both("false", "step_seconds")
    on_wait, off_wait = both("true", "collective_wait_seconds"), both("false", "collective_wait_seconds")
    print(f"LLM TP2{' + SP' if sp == 'true' else ''}: blocked in TP collectives per step "
          f"{on_wait:.4f} s overlapped, {off_wait:.4f} s waiting where issued "
          f"({1 - on_wait / off_wait:.3f} of it hidden); step time waiting / overlapped: "
          f"{off_step / on_step:.3f}x")
def zero(z, key):  # the mean of the two rounds' medians
    return statistics.mean(med(load(f"dp2_zero{z}_{r}"), key) for r in (1, 2))
print(f"DP2 with ZeRO-1 / without: step time {zero(1, 'step_seconds') / zero(0, 'step_seconds'):.3f}x; "
      f"exposed gradient reduction {zero(1, 'grad_sync_seconds'):.4f} s vs {zero(0, 'grad_sync_seconds'):.4f} s; "
      f"optimizer step (with what ZeRO-1's parameter all-gather waits for there) "
      f"{zero(1, 'optimizer_seconds'):.4f} s vs {zero(0, 'optimizer_seconds'):.4f} s")
print(f"ZeRO-1's parameter all-gather waited for after the optimizer / overlapped with the next "
      f"forward: step time {zero('1w', 'step_seconds') / zero(1, 'step_seconds'):.3f}x; optimizer "
      f"step {zero('1w', 'optimizer_seconds'):.4f} s vs {zero(1, 'optimizer_seconds'):.4f} s; "
      f"forward waiting for parameters {zero(1, 'param_wait_seconds'):.4f} s overlapped")
def compare(prefix, what, names, wait_key, waiting):  # ab_runs' runs: true vs false
    print(f"{what} through shared memory vs over Gloo (mean of two rounds' medians):")
    for key, label in names.items():
        def both(shm, k):
            return statistics.mean(med(load(f"{prefix}_{key}_{shm}_{r}"), k) for r in (1, 2))
        losses = {shm: [r["loss"] for r in load(f"{prefix}_{key}_{shm}_1")] for shm in ("true", "false")}
        same = "identical" if losses["true"] == losses["false"] else (
            f"differ by at most {max(abs(a - b) for a, b in zip(losses['true'], losses['false'])):.2e}")
        print(f"  {label}: step {both('true', 'step_seconds'):.4f} s vs {both('false', 'step_seconds'):.4f} s "
              f"({both('true', 'step_seconds') / both('false', 'step_seconds'):.2f}x); {waiting} "
              f"{both('true', wait_key):.4f} s vs {both('false', wait_key):.4f} s; losses {same}")
compare("shm", "blocking collectives",
        {"tp2": "LLM TP2", "tp2sp": "LLM TP2 + SP", "tp2sp_both": "TP2 + SP, vision and LLM",
         "cp2": "LLM CP2", "dp2": "DP2"}, "collective_wait_seconds", "blocked in collectives")
compare("msg", "point-to-point messages",
        {"pp2": "LLM PP2", "pp2vp2": "LLM PP2 x VP2", "separate": "vision | LLM on separate ranks"},
        "p2p_wait_seconds", "blocked in receives")
PY
