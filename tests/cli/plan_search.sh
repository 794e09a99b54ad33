#!/usr/bin/env bash
# `weft plan --cluster`: the layout search writes a Plan and a config snippet; the snippet fed back
# (as --set flags) gives the same Plan; `weft simulate --plan` predicts the step the search
# reported; bad plan files and flags are clear errors; without --cluster `weft plan` prints the
# config's own Plan as before; and DistTrain's 72B + 6B model on 1172 H100s plans within a
# generous bound (bench/RESULTS.md has the measured time).
set -u
weft=$1; src=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
die() { echo "FAIL: $*"; exit 1; }
mkdir -p "$tmp/my configs"  # a path that needs quoting in a shell
cp "$src/configs/small-vlm.toml" "$tmp/my configs/small vlm.toml"
config="$tmp/my configs/small vlm.toml"
cluster="$src/configs/clusters/h200-8x4.toml"

"$weft" plan "$config" --cluster "$cluster" --out "$tmp/plan.json" --snippet "$tmp/snippet.toml" \
  --json "$tmp/search.json" > "$tmp/out.txt" || { cat "$tmp/out.txt"; die "weft plan --cluster failed"; }
grep -q "^why: " "$tmp/out.txt" || { cat "$tmp/out.txt"; die "no line on why the winner won"; }
grep -q "step s.*MFU.*GiB/GPU" "$tmp/out.txt" || die "no table of candidates"
head -12 "$tmp/out.txt"

# --partial-recompute searches recompute_blocks too, and the snippet sets it for every module.
"$weft" plan "$config" --cluster "$cluster" --partial-recompute --snippet "$tmp/partial.toml" \
  > "$tmp/partial.txt" || { cat "$tmp/partial.txt"; die "weft plan --partial-recompute failed"; }
[ "$(grep -c '^recompute_blocks = ' "$tmp/partial.toml")" = 2 ] \
  || { cat "$tmp/partial.toml"; die "the snippet does not set recompute_blocks per module"; }

# The snippet as --set flags reproduces the plan, and simulating that plan gives the predicted step.
/usr/bin/python3 - "$tmp/snippet.toml" "$tmp/search.json" > "$tmp/sets" <<'PY' || die "bad snippet or summary"
import json, sys, tomllib
snippet = tomllib.load(open(sys.argv[1], "rb"))
summary = json.load(open(sys.argv[2]))
assert summary["stats"]["complete"] and summary["best"], summary
sets = []
def walk(prefix, table):
    for k, v in table.items():
        if isinstance(v, dict):
            walk(prefix + k + ".", v)
        else:
            sets.append(prefix + k + "=" + json.dumps(v).replace(" ", ""))
walk("", snippet)
norm = lambda l: sorted(s.replace('"', "").replace(" ", "") for s in l)
assert norm(sets) == norm(summary["best"][0]["overrides"]), (sets, summary["best"][0]["overrides"])
steps = [b["step_seconds"] for b in summary["best"]]
assert steps == sorted(steps), steps
print(" ".join("--set " + s for s in sets))
PY
world=$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["world_size"])' "$tmp/plan.json")
# shellcheck disable=SC2046
"$weft" plan "$config" --world-size "$world" $(cat "$tmp/sets") > "$tmp/again.json" \
  || die "the snippet does not make a valid config"
/usr/bin/python3 - "$tmp/plan.json" "$tmp/again.json" <<'PY' || die "the snippet does not reproduce the plan"
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
assert a == b, (a, b)
print("the snippet reproduces the plan:", a["placement"], [(m["name"], m["layout"]) for m in a["modules"] if m["role"] != "projector"])
PY
# The printed `or: weft plan ...` line runs as printed, in a shell, to the same plan; with the
# user's own --set flags (a quoted string among them) kept.
"$weft" plan "$config" --cluster "$cluster" --set 'train.steps=70' --set "data.kind=\"synthetic\"" \
  --out "$tmp/plan_sets.json" > "$tmp/out_sets.txt" || die "weft plan --cluster --set failed"
or=$(grep '^or: weft plan ' "$tmp/out_sets.txt" | sed 's/^or: weft //')
[ -n "$or" ] || { cat "$tmp/out_sets.txt"; die "no command line printed"; }
grep -q -- "--set train.steps=70 --set 'data.kind=\"synthetic\"'" <<< "$or" \
  || die "the user's --set flags are not in the printed command line: $or"
eval "\"\$weft\" $or" > "$tmp/or.json" || die "the printed command line fails: $or"
cmp -s "$tmp/plan_sets.json" "$tmp/or.json" || die "the printed command line gives another plan: $or"
# shellcheck disable=SC2046
"$weft" simulate "$config" --cluster "$cluster" --plan "$tmp/plan.json" $(grep -o -- '--set [^ ]*\(zero_stage\|recompute\)=[^ ]*' "$tmp/sets") \
  --trace "$tmp/trace.json" > "$tmp/sim.json" || die "weft simulate --plan failed"
/usr/bin/python3 - "$tmp/sim.json" "$tmp/search.json" <<'PY' || die "simulate --plan disagrees with the search"
import json, sys
sim, summary = (json.load(open(p)) for p in sys.argv[1:])
want = summary["best"][0]["step_seconds"]
assert abs(sim["step_seconds"] - want) <= 1e-9 * want, (sim["step_seconds"], want)
assert sim["plan"]["world_size"] == sim["world_size"], sim["world_size"]
print("weft simulate --plan predicts the searched step:", sim["step_seconds"], "s")
PY

# A plan file edited by hand: the error names the file and the field.
/usr/bin/python3 - "$tmp/plan.json" "$tmp/bad.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
p["modules"][-1]["layout"]["tp"] = "eight"
json.dump(p, open(sys.argv[2], "w"))
PY
"$weft" simulate "$config" --cluster "$cluster" --plan "$tmp/bad.json" > "$tmp/err" 2>&1 \
  && die "a bad plan file was accepted"
grep -q 'bad.json: modules\[2\].layout.tp = "eight": expected an integer' "$tmp/err" \
  || { cat "$tmp/err"; die "unclear error for a bad plan file"; }
echo "bad plan file: $(grep -o 'error:.*' "$tmp/err")"
"$weft" plan "$config" --out "$tmp/x.json" > "$tmp/err" 2>&1 && die "--out without --cluster was accepted"
grep -q "need --cluster" "$tmp/err" || { cat "$tmp/err"; die "unclear error for --out without --cluster"; }

# The FLOP model prices the data's mean sample (the shapes dataset's rows of about 25 of 64
# tokens, a few loss targets each), or with --full-rows rows of max_seq tokens: the summaries say
# which, `weft simulate` takes the same, and full rows predict a slower step.
tiny="$src/configs/tiny-vlm.toml"
cpu="$src/configs/clusters/cpu-local.toml"
"$weft" plan "$tiny" --cluster "$cpu" --world-size 2 --json "$tmp/data.json" > "$tmp/data.txt" \
  || { cat "$tmp/data.txt"; die "weft plan on the data's shape failed"; }
grep -q "^priced on the data's mean sample (1024 samples)" "$tmp/data.txt" \
  || { cat "$tmp/data.txt"; die "weft plan does not say what it priced"; }
"$weft" plan "$tiny" --cluster "$cpu" --world-size 2 --full-rows --json "$tmp/full.json" \
  > "$tmp/full.txt" || die "weft plan --full-rows failed"
grep -q "^priced on full rows: 64 tokens per sample" "$tmp/full.txt" \
  || { cat "$tmp/full.txt"; die "weft plan --full-rows does not say it priced full rows"; }
"$weft" simulate "$tiny" --cluster "$cpu" --world-size 2 > "$tmp/sim_data.json" \
  || die "weft simulate on the data's shape failed"
"$weft" simulate "$tiny" --cluster "$cpu" --world-size 2 --full-rows > "$tmp/sim_full.json" \
  || die "weft simulate --full-rows failed"
/usr/bin/python3 - "$tiny" "$tmp/data.json" "$tmp/full.json" "$tmp/sim_data.json" \
  "$tmp/sim_full.json" <<'PY' || die "the data's shape is not what was priced"
import json, sys, tomllib
batch = tomllib.load(open(sys.argv[1], "rb"))["train"]["batch"]
plan_data, plan_full, sim_data, sim_full = (json.load(open(p)) for p in sys.argv[2:])
d = plan_data["data_shape"]
assert d["samples"] == 1024 and 0 < d["tokens"] <= d["positions"] < 64, d
assert 0 < d["targets"] < d["tokens"] and d["items"] == {"vision": 1.0}, d
p = d["peak"]  # activation memory: the longest sample's row
assert d["positions"] <= p["positions"] <= 64 and p["targets"] >= d["targets"], d
assert p["items"] == {"vision": 1.0}, d
assert plan_full["data_shape"] == {"rows": "full", "positions": 64}, plan_full["data_shape"]
assert sim_data["data_shape"] == d, (sim_data["data_shape"], d)
assert abs(sim_data["tokens_per_step"] - batch * d["positions"]) < 1e-9, sim_data["tokens_per_step"]
assert sim_full["tokens_per_step"] == batch * 64, sim_full["tokens_per_step"]
assert sim_full["step_seconds"] > 1.3 * sim_data["step_seconds"], (sim_full["step_seconds"], sim_data["step_seconds"])
print("priced on %.1f of 64 positions, %.1f targets: step %.4f s (full rows %.4f s)" % (
    d["positions"], d["targets"], sim_data["step_seconds"], sim_full["step_seconds"]))
PY

# Without --cluster: the config's own plan, as before.
"$weft" plan "$src/configs/tiny-vlm.toml" --world-size 2 --set parallel.llm.pp=2 > "$tmp/own.json" \
  || die "weft plan without --cluster failed"
grep -q '"schedule": "1f1b"' "$tmp/own.json" || die "weft plan without --cluster lost its output"

# DistTrain's MLLM-72B scale on 1172 H100s (147 nodes, 1172 devices used at most).
cat > "$tmp/h100-147.toml" <<'EOF'
nodes = 147
gpus_per_node = 8
device = "h100"
[intra_node]
bandwidth_gbs = 450
latency_us = 3
[inter_node]
bandwidth_gbs = 50
latency_us = 8
EOF
start=$(date +%s)
"$weft" plan "$src/configs/scenarios/disttrain-72b.toml" --cluster "$tmp/h100-147.toml" \
  --world-size 1172 --json "$tmp/72b.json" > "$tmp/72b.txt" || { cat "$tmp/72b.txt"; die "72B plan failed"; }
seconds=$(( $(date +%s) - start ))
grep -E "^ *1 |^why" "$tmp/72b.txt"
echo "72B + 6B on 1172 H100s planned in ${seconds} s"
[ "$seconds" -le 120 ] || die "planning 72B on 1172 GPUs took ${seconds} s (the target is a minute)"
