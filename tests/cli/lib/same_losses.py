"""Checks that two runs' loss curves (metrics.jsonl) have `steps` steps and agree to 1e-5 relative.

usage: same_losses.py REFERENCE_METRICS OTHER_METRICS STEPS LABEL
"""
import json
import sys

ref, other, steps, label = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
a = [json.loads(line)["loss"] for line in open(ref)]
b = [json.loads(line)["loss"] for line in open(other)]
assert len(a) == len(b) == steps, (a, b)
for x, y in zip(a, b):
    assert abs(x - y) <= 1e-5 * abs(x), (a, b)
print(label, "matches one process:", a, b)
