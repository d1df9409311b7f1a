#!/bin/bash
python3 - <<'PY'
p = "/app/report.py"
s = open(p).read()
s = s.replace("""        for line in f:
            events.append(json.loads(line))""", """        for line in f:
            if line.strip():
                events.append(json.loads(line))""")
s = s.replace('u["total_ms"] += ev["duration_ms"]', 'u["total_ms"] += ev.get("duration_ms") or 0')
s = s.replace('if ev["status"] == "error":', 'if str(ev["status"]).lower() == "error":')
s = s.replace('round(errors / len(events), 4)', 'round(errors / len(events), 4) if events else 0.0')
open(p, "w").write(s)
PY
