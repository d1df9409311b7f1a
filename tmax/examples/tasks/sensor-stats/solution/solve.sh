#!/bin/bash
python3 - <<'PY'
import csv
import json
import statistics

vals = {}
with open("/app/data/readings.csv", newline="") as f:
    for row in csv.DictReader(f):
        v = row["temp_f"].strip()
        if v in ("", "NA") or float(v) == -999:
            continue
        vals.setdefault(row["sensor_id"], []).append((float(v) - 32) * 5 / 9)
out = {s: {"count": len(c), "mean_c": round(statistics.mean(c), 3),
           "std_c": round(statistics.stdev(c), 3), "min_c": round(min(c), 3),
           "max_c": round(max(c), 3)} for s, c in sorted(vals.items())}
json.dump(out, open("/app/stats.json", "w"), indent=2)
PY
