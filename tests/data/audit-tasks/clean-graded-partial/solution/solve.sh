#!/bin/bash
python3 - <<'PY'
import collections
import json
rows = [l.split() for l in open("/app/data/requests.log") if l.strip()]
paths = collections.Counter(r[2] for r in rows)
json.dump({
    "total_requests": len(rows),
    "unique_ips": len({r[0] for r in rows}),
    "top_path": min(paths, key=lambda p: (-paths[p], p)),
    "server_errors": sum(int(r[3]) >= 500 for r in rows),
}, open("/app/answers.json", "w"), indent=2)
PY
