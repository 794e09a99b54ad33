#!/usr/bin/env bash
# `weft inspect balance`: on the LLaVA-like mix the balanced assignment's per-microbatch work CV
# is at least 10x lower than the sequential one's; every sample is assigned exactly once; the
# config's own dataset works too; a bad mix is a clear error.
set -u
weft=$1; src=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
die() { echo "FAIL: $*"; exit 1; }

"$weft" inspect balance "$src/configs/tiny-vlm.toml" --mix llava --batch 128 --replicas 4 \
  --microbatches 4 --pp 2 --seed 7 > "$tmp/llava.json" || die "inspect balance failed"
python3 - "$tmp/llava.json" <<'PY' || die "bad balance output"
import json, sys
j = json.load(open(sys.argv[1]))
s = j["summary"]
assert s["cv_reduction"] >= 10, s
for policy in ("in_order", "balanced"):
    seen = sorted(i for r in j["policies"][policy]["replicas"] for m in r["microbatches"] for i in m["samples"])
    assert seen == list(range(128)), policy
print("llava mix, D=4 M=4: microbatch CV %.4f -> %.4f (%.1fx lower), max/mean %.3f -> %.3f" % (
    s["microbatch_cv_in_order"], s["microbatch_cv_balanced"], s["cv_reduction"],
    s["max_over_mean_in_order"], s["max_over_mean_balanced"]))
PY
"$weft" inspect balance "$src/configs/tiny-valm.toml" --mix shapes --replicas 2 > "$tmp/shapes.json" \
  || die "inspect balance on the config's dataset failed"
"$weft" inspect balance "$src/configs/tiny-vlm.toml" --mix podcasts > "$tmp/out" 2>&1 \
  && die "an unknown mix was accepted"
grep -q -- "--mix podcasts: expected llava, video, interleaved or shapes" "$tmp/out" \
  || { cat "$tmp/out"; die "unclear error for an unknown mix"; }
# Interleaved 1F1B: microbatches ordered by its makespan, which is shorter than plain 1F1B's
# (the bubble shrinks vp-fold); --vp needs --pp.
for vp in 1 2; do
  "$weft" inspect balance "$src/configs/tiny-vlm.toml" --mix llava --batch 64 --replicas 2 \
    --microbatches 6 --pp 2 --vp $vp > "$tmp/vp$vp.json" || die "inspect balance --vp $vp failed"
done
python3 - "$tmp/vp1.json" "$tmp/vp2.json" <<'PY' || die "bad interleaved balance output"
import json, sys
one, two = (json.load(open(p)) for p in sys.argv[1:])
assert two["virtual_stages"] == 2 and two["pipeline_stages"] == 2, two
seen = sorted(i for r in two["policies"]["balanced"]["replicas"] for m in r["microbatches"] for i in m["samples"])
assert seen == list(range(64))
a, b = (j["policies"]["balanced"]["max_makespan"] for j in (one, two))
assert b < 0.95 * a, (a, b)
print("interleaved makespan / plain 1F1B's: %.3f" % (b / a))
PY
"$weft" inspect balance "$src/configs/tiny-vlm.toml" --vp 2 > "$tmp/out" 2>&1 \
  && die "--vp without --pp was accepted"
grep -q -- "--vp = 2: interleaved 1F1B needs more than one pipeline stage (--pp)" "$tmp/out" \
  || { cat "$tmp/out"; die "unclear error for --vp without --pp"; }
