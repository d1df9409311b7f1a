#!/bin/bash
python3 - <<'PY'
import json
import re

src = open("/app/etc/service.json").read()
out, i, in_str, quote = [], 0, False, ""
# walk the text: drop // comments outside strings, turn '...' strings into "..."
while i < len(src):
    c = src[i]
    if in_str:
        if c == "\\":
            out.append(src[i:i + 2]); i += 2; continue
        if c == quote:
            out.append('"'); in_str = False
        else:
            out.append('\\"' if c == '"' else c)
        i += 1
        continue
    if c in "\"'":
        in_str, quote = True, c
        out.append('"'); i += 1; continue
    if src.startswith("//", i):
        while i < len(src) and src[i] != "\n":
            i += 1
        continue
    out.append(c); i += 1
text = "".join(out)
text = re.sub(r",(\s*[}\]])", r"\1", text)           # trailing commas
text = re.sub(r"\bFalse\b", "false", text)
text = re.sub(r"\bTrue\b", "true", text)
cfg = json.loads(text)
cfg["listen"]["port"] = 8443
cfg["tls"]["enabled"] = True
with open("/app/etc/service.json", "w") as f:
    json.dump(cfg, f, indent=2)
    f.write("\n")
PY
