#!/bin/bash
# Verifier: always leaves exactly one float in /logs/verifier/reward.txt.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
# diff fails when the file is missing; keep the script going either way
diff /tests/expected.txt /app/reversed.txt || true && echo 1 > /logs/verifier/reward.txt
exit 0
