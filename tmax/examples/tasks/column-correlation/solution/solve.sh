#!/bin/bash
python3 - <<'PY'
import csv
import itertools
import json
import statistics

with open("/app/data/features.csv", newline="") as f:
    rows = list(csv.DictReader(f))
cols = list(rows[0].keys())
data = {c: [float(r[c]) for r in rows] for c in cols}
corr = {tuple(sorted((a, b))): statistics.correlation(data[a], data[b])
        for a, b in itertools.combinations(cols, 2)}
best = max(corr, key=lambda p: abs(corr[p]))
json.dump({"pair": list(best), "r": round(corr[best], 4),
           "strong_pairs": sum(abs(v) >= 0.5 for v in corr.values())},
          open("/app/correlation.json", "w"))
PY
