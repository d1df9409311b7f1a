#!/bin/bash
cd /app/project
secret=$(grep -rhoiE 'aws_secret_access_key *[=:] *"?[A-Za-z0-9/+]{40}' . | head -n 1 \
         | grep -oE '[A-Za-z0-9/+]{40}$')
grep -rlF -- "$secret" /app/project | sort > /app/leak.txt
python3 - "$secret" <<'PY'
import sys
secret = sys.argv[1]
for path in open("/app/leak.txt").read().split():
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data.replace(secret.encode(), b"REDACTED"))
PY
