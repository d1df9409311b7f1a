#!/bin/bash
python3 - <<'PY'
import json
import statistics
s = [int(l) for l in open("/app/data/scores.txt") if l.strip()]
json.dump({"count": len(s), "mean": round(statistics.mean(s), 2), "median": statistics.median(s)},
          open("/app/stats.json", "w"))
PY
