#!/usr/bin/env bash
# `weft bench profile`: profiles a small config quickly; the JSON has the device, threads,
# precision, the profiled shape, the data's mean sample, the data preparation and, per module, every layer's measured
# seconds, bytes and fit, every block plain and recomputed; `weft simulate --profile` accepts it
# and predicts a positive step that differs from the FLOP model's, and prices recomputation of
# every block or of some from it; `weft plan --profile` searches on it; an MoE config gets a dense and an MoE block, and expert
# parallelism is priced on them; bad flags, files and mismatched configs are clear errors.
set -u
weft=$1; src=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
die() { echo "FAIL: $*"; exit 1; }
cfg="$src/configs/tiny-valm.toml"
small=(--set train.batch=8 --set train.threads=1)

# The config's layout, per-stage recomputation counts included, does not matter: one process.
"$weft" bench profile "$cfg" "${small[@]}" --set parallel.llm.pp=2 --set model.llm.recompute=true \
  --set 'model.llm.recompute_blocks=[1,0]' --reps 2 --warmup 1 --out "$tmp/p.json" \
  > "$tmp/stdout.json" || die "bench profile failed"
cmp -s "$tmp/p.json" "$tmp/stdout.json" || die "--out differs from stdout"
python3 - "$tmp/p.json" <<'PY' || die "bad profile JSON"
import json, sys
p = json.load(open(sys.argv[1]))
assert p["format"] == "weft-profile-2" and p["threads"] == 1 and p["precision"] == "bf16", p
assert p["device"] and p["shape"]["samples"] == 8 and 0 < p["shape"]["seq"] <= 64, p["shape"]
assert p["shape"]["max_seq"] == 64 and p["data"]["seconds_per_sample"] > 0, p
assert p["comm"]["all_reduce"]["bandwidth_gbs"] > 0 and p["comm"]["p2p"]["latency_us"] > 0
mods = {m["name"]: m for m in p["modules"]}
assert set(mods) == {"llm", "vision", "audio"}, set(mods)
parts = {"llm": ["front", "stage", "block", "block_recompute", "back"],
         "vision": ["front", "block", "block_recompute", "back"],
         "audio": ["front", "block", "block_recompute", "back"]}
for name, m in mods.items():
    layers = {l["part"]: l for l in m["layers"]}
    assert sorted(layers) == sorted(parts[name]), (name, sorted(layers))
    assert m["model"]["hidden"] > 0 and m["units_per_sample"] > 0, m
    for part, l in layers.items():
        for key in ("forward", "input_grad", "weight_grad", "activation_bytes", "param_bytes",
                    "optimizer"):
            assert l[key] >= 0, (name, part, key, l[key])
        assert l["forward"] > 0, (name, part)
        assert len(l["fit"]["forward"]) == 3 and min(l["fit"]["forward"]) >= 0, l["fit"]
        assert len(l["points"]) >= 2, (name, part, l["points"])
    block = layers["block"]
    assert block["input_grad"] > 0 and block["weight_grad"] >= 0, block
    # Recomputed, a block keeps less (its input and output, not its intermediates).
    again = layers["block_recompute"]
    assert again["activation_bytes"] < block["activation_bytes"], (name, again, block)
    assert again["param_bytes"] == block["param_bytes"], (name, again, block)
    assert block["activation_bytes"] > 0 and block["param_bytes"] > 0 and block["params"] > 0
    assert layers["front"]["weight_grad"] > 0, (name, layers["front"])
    if name != "llm":  # an encoder's front end takes data: no input gradient
        assert layers["front"]["input_grad"] == 0, layers["front"]
    else:  # the LLM's quadratic term was measured at two sequence lengths
        assert {q["seq"] for q in block["points"]} == {p["shape"]["profiled_seq"],
                                                       p["shape"]["profiled_seq"] // 2}
print("profile:", p["device"], "| llm block fwd %.2e s, input grad %.2e s, weight grad %.2e s"
      % (mods["llm"]["layers"][2]["forward"], mods["llm"]["layers"][2]["input_grad"],
         mods["llm"]["layers"][2]["weight_grad"]))
PY

cluster="$src/configs/clusters/cpu-local.toml"
sim=(simulate "$cfg" --cluster "$cluster" "${small[@]}" --set parallel.llm.pp=2
     --set train.microbatches=2)
"$weft" "${sim[@]}" > "$tmp/flops.json" || die "simulate (FLOP model) failed"
"$weft" "${sim[@]}" --profile "$tmp/p.json" > "$tmp/measured.json" \
  || die "simulate --profile failed"
python3 - "$tmp/flops.json" "$tmp/measured.json" <<'PY' || die "bad simulate --profile output"
import json, sys
f, m = (json.load(open(x)) for x in sys.argv[1:3])
assert m["profile"].endswith("p.json") and "profile" not in f
fs, ms = f["step_seconds"], m["step_seconds"]
assert ms > 0 and ms != fs, (fs, ms)
assert all(r["data_seconds"] > 0 for r in m["ranks"]), m["ranks"]
assert all(r["data_seconds"] == 0 for r in f["ranks"]), f["ranks"]
assert len(m["stage_boundaries"]["llm"]) == 1, m["stage_boundaries"]
print("simulated PP2 step: FLOP model %.4f s, measured profile %.4f s" % (fs, ms))
PY
# The profile records the data's mean sample as `weft simulate` measures it without a profile
# (the same data; the padding follows each config's own microbatches, 2 here and 1 profiled);
# `weft simulate --profile` prices and writes the recorded shape, and the profile's encoders'
# items per sample are it.
python3 - "$tmp/p.json" "$tmp/flops.json" "$tmp/measured.json" <<'PY' \
  || die "the profile's data shape is not the data's"
import json, sys
p, f, m = (json.load(open(x)) for x in sys.argv[1:4])
d = p["data_shape"]
assert d == m["data_shape"], (d, m["data_shape"])
padded = lambda x: {k: v for k, v in x.items() if k != "positions"}
assert padded(d) == padded(f["data_shape"]), (d, f["data_shape"])
assert d["positions"] >= f["data_shape"]["positions"], (d, f["data_shape"])
assert d["samples"] == 64 * 8 and 0 < d["targets"] < d["tokens"] <= d["positions"] <= 64, d
assert p["shape"]["tokens_per_sample"] == d["tokens"], (p["shape"], d)
for mod in p["modules"]:
    if mod["role"] == "encoder":
        assert mod["units_per_sample"] == d["items"][mod["name"]], (mod["name"], d)
print("profiled data shape (64 batches of 8): %.1f tokens in %.1f positions, %.1f targets" %
      (d["tokens"], d["positions"], d["targets"]))
PY

# Recomputation priced from the profile's recomputed blocks, whatever the profiled config ran:
# none, the first block of stage 0 only ([1, 0]), every block. Rank 0 (stage 0) keeps less
# activation memory with its block recomputed, rank 1 only when every block is.
"$weft" "${sim[@]}" --profile "$tmp/p.json" --set model.llm.recompute=true \
  --set 'model.llm.recompute_blocks=[1,0]' > "$tmp/some.json" || die "simulate --profile [1,0]"
"$weft" "${sim[@]}" --profile "$tmp/p.json" --set model.llm.recompute=true > "$tmp/all.json" \
  || die "simulate --profile, every block recomputed"
python3 - "$tmp/measured.json" "$tmp/some.json" "$tmp/all.json" <<'PY' \
  || die "recomputation not priced from the profile"
import json, sys
none, some, every = ([r["peak_activation_bytes"] for r in json.load(open(x))["ranks"]]
                     for x in sys.argv[1:4])
assert none[0] > some[0] == every[0], (none, some, every)
assert none[1] == some[1] > every[1], (none, some, every)
print("measured activation peaks (rank 0, rank 1): none %s, [1,0] %s, all %s" % (none, some, every))
PY

# The layout search priced by the profile: its winner's --set flags, simulated with the same
# profile, give the step it reports. Without --cluster, make_plan cuts the stages on the profile:
# a 4-block LLM whose head (as doctored) costs 50 blocks gets fewer blocks on its last stage than
# the FLOP model's cut.
"$weft" plan "$cfg" --cluster "$cluster" "${small[@]}" --profile "$tmp/p.json" \
  --json "$tmp/search.json" > "$tmp/search.txt" || die "plan --profile failed"
grep -q "priced by the measured profile .*p.json" "$tmp/search.txt" \
  || { cat "$tmp/search.txt"; die "plan --profile does not say it is priced by the profile"; }
python3 - "$tmp/search.json" > "$tmp/winner.args" <<'PY' || die "bad plan --profile summary"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["profile"].endswith("p.json"), j
w = j["best"][0]
assert w["step_seconds"] > 0 and 0 < w["mfu"] < 1, w
print(w["world_size"], w["step_seconds"])
for o in w["overrides"]:
    print(o)
PY
read -r world step < <(head -1 "$tmp/winner.args")
mapfile -t won < <(tail -n +2 "$tmp/winner.args")
"$weft" simulate "$cfg" --cluster "$cluster" --world-size "$world" "${small[@]}" \
  $(printf -- "--set %s " "${won[@]}") --profile "$tmp/p.json" > "$tmp/won.json" \
  || die "simulate of the searched plan failed"
python3 - "$tmp/won.json" "$step" <<'PY' || die "the searched plan's step does not reproduce"
import json, sys
got, want = json.load(open(sys.argv[1]))["step_seconds"], float(sys.argv[2])
assert abs(got - want) <= 1e-6 * want, (got, want)
print("plan --profile: winner's step %.5f s, simulated again %.5f s" % (want, got))
PY
python3 - "$tmp/p.json" "$tmp/heavy.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
llm = next(m for m in p["modules"] if m["name"] == "llm")
block = next(l for l in llm["layers"] if l["part"] == "block")
head = next(l for l in llm["layers"] if l["part"] == "back")
for q in ("forward", "input_grad", "weight_grad"):
    head["fit"][q] = [50 * v for v in block["fit"][q]]
    head["fit"].pop("shared", None)
json.dump(p, open(sys.argv[2], "w"))
PY
cut=("$weft" plan "$cfg" --world-size 2 "${small[@]}" --set parallel.llm.pp=2
     --set model.llm.layers=4)
"${cut[@]}" > "$tmp/flop_cut.json" || die "plan without --cluster failed"
"${cut[@]}" --profile "$tmp/heavy.json" > "$tmp/heavy_cut.json" \
  || die "plan --profile without --cluster failed"
python3 - "$tmp/flop_cut.json" "$tmp/heavy_cut.json" <<'PY' || die "plan --profile: not cut on it"
import json, sys
flop, heavy = ([m for m in json.load(open(x))["modules"] if m["name"] == "llm"][0]
               ["stage_boundaries"] for x in sys.argv[1:3])
assert len(flop) == len(heavy) == 1 and heavy[0] > flop[0], (flop, heavy)
print("PP2 cut of a 4-block LLM: FLOP model %s, profile with a heavy head %s" % (flop, heavy))
PY

# Errors: a profile of another model, a broken file, bad flags.
"$weft" "${sim[@]}" --set model.llm.hidden=192 --profile "$tmp/p.json" > "$tmp/out" 2>&1 \
  && die "a profile of another model was accepted"
grep -q "p.json: module 'llm' was profiled with hidden = 128" "$tmp/out" \
  || { cat "$tmp/out"; die "mismatch error does not name the file, module and field"; }
"$weft" plan "$cfg" --cluster "$cluster" "${small[@]}" --set model.llm.hidden=192 \
  --profile "$tmp/p.json" > "$tmp/out" 2>&1 && die "plan: a profile of another model was accepted"
grep -q "p.json: module 'llm' was profiled with hidden = 128" "$tmp/out" \
  || { cat "$tmp/out"; die "plan: mismatch error does not name the file, module and field"; }
"$weft" "${sim[@]}" --profile "$tmp/p.json" --full-rows > "$tmp/out" 2>&1 \
  && die "--full-rows with --profile was accepted"
grep -q "measured on its own rows" "$tmp/out" || { cat "$tmp/out"; die "unclear --full-rows error"; }
python3 - "$tmp/p.json" "$tmp/broken.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
del p["modules"][0]["layers"][2]["fit"]
json.dump(p, open(sys.argv[2], "w"))
PY
"$weft" "${sim[@]}" --profile "$tmp/broken.json" > "$tmp/out" 2>&1 \
  && die "a broken profile was accepted"
grep -q "broken.json: modules\[0\].layers\[2\].fit: missing" "$tmp/out" \
  || { cat "$tmp/out"; die "broken-profile error does not name the file and field"; }
# An MoE LLM: a dense block and an MoE block (block 0; block 1 dense with every = 2), and the
# simulator prices expert parallelism on the measured costs.
moe=(--set train.batch=8 --set train.threads=1 --set model.llm.moe.every=2)
"$weft" bench profile "$src/configs/tiny-vlm-moe.toml" "${moe[@]}" --reps 2 --warmup 1 \
  --no-comm --out "$tmp/moe.json" > /dev/null || die "bench profile of the MoE config failed"
for ep in 1 2; do
  "$weft" simulate "$src/configs/tiny-vlm-moe.toml" --cluster "$cluster" --world-size 2 \
    "${moe[@]}" --set parallel.llm.dp=2 --set parallel.vision.dp=2 --set parallel.llm.ep=$ep \
    --profile "$tmp/moe.json" > "$tmp/moe_ep$ep.json" || die "simulate --profile (MoE, ep $ep)"
done
python3 - "$tmp/moe.json" "$tmp/moe_ep1.json" "$tmp/moe_ep2.json" <<'PY' || die "bad MoE profile"
import json, sys
p, e1, e2 = (json.load(open(x)) for x in sys.argv[1:4])
llm = next(m for m in p["modules"] if m["name"] == "llm")
layers = {l["part"]: l for l in llm["layers"]}
assert sorted(layers) == ["back", "block", "block_recompute", "front", "moe_block",
                          "moe_block_recompute", "stage"], sorted(layers)
assert llm["model"]["moe_experts"] == 4 and llm["model"]["moe_top_k"] == 2, llm["model"]
dense, moe = layers["block"], layers["moe_block"]
assert moe["params"] > dense["params"] and moe["forward"] > 0 and moe["weight_grad"] >= 0, moe
# EP2: the all-to-alls inside the ops, and half the experts' state per rank.
assert all(r["comm_seconds"] == 0 for r in e1["ranks"]), e1["ranks"]
assert all(r["comm_seconds"] > 0 for r in e2["ranks"]), e2["ranks"]
assert e2["ranks"][0]["static_bytes"] < e1["ranks"][0]["static_bytes"]
print("MoE profile: dense block fwd %.2e s, MoE block fwd %.2e s; EP2 step %.4f s vs %.4f s"
      % (dense["forward"], moe["forward"], e2["step_seconds"], e1["step_seconds"]))
PY
python3 - "$tmp/moe.json" "$tmp/nomoe.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
llm = next(m for m in p["modules"] if m["name"] == "llm")
llm["layers"] = [l for l in llm["layers"]
                 if l["part"] not in ("moe_block", "moe_block_recompute")]
json.dump(p, open(sys.argv[2], "w"))
PY
"$weft" simulate "$src/configs/tiny-vlm-moe.toml" --cluster "$cluster" "${moe[@]}" \
  --profile "$tmp/nomoe.json" > "$tmp/out" 2>&1 && die "a profile without an MoE block was accepted"
grep -q 'nomoe.json: has no "moe_block" layer' "$tmp/out" \
  || { cat "$tmp/out"; die "missing-moe_block error does not name the file and the layer"; }

"$weft" bench profile "$cfg" --reps 0 > "$tmp/out" 2>&1 && die "--reps 0 accepted"
grep -q -- "--reps" "$tmp/out" || { cat "$tmp/out"; die "unclear error for --reps 0"; }
"$weft" bench profile "$tmp/none.toml" > "$tmp/out" 2>&1 && die "a missing config was accepted"
grep -q "none.toml" "$tmp/out" || { cat "$tmp/out"; die "error does not name the config"; }
echo "PASS"
