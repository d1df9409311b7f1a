#!/bin/bash
# Reference solution: /app/vsort in Python (SemVer 2.0.0 grammar as a regular expression,
# precedence as a sort key; Python's sort is stable).
set -euo pipefail
cat > /app/vsort <<'PY'
#!/usr/bin/env python3
"""vsort: sort SemVer 2.0.0 versions read from stdin by precedence; report invalid lines."""

import re
import sys

NUM = r"(?:0|[1-9][0-9]*)"
IDENT = r"(?:0|[1-9][0-9]*|[0-9]*[A-Za-z-][0-9A-Za-z-]*)"
SEMVER = re.compile(rf"({NUM})\.({NUM})\.({NUM})(?:-({IDENT}(?:\.{IDENT})*))?"
                    r"(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?")


def key(match):
    major, minor, patch, pre = match.groups()
    if pre is None:
        return (int(major), int(minor), int(patch), 1, ())
    ids = tuple((0, int(i), "") if i.isdigit() else (1, 0, i) for i in pre.split("."))
    return (int(major), int(minor), int(patch), 0, ids)


def main():
    valid, bad = [], 0
    for line in sys.stdin.read().splitlines():
        if not line:
            continue
        match = SEMVER.fullmatch(line)
        if match is None:
            print(f"invalid: {line}", file=sys.stderr)
            bad += 1
        else:
            valid.append((key(match), line))
    valid.sort(key=lambda kv: kv[0])
    sys.stdout.write("".join(line + "\n" for _, line in valid))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
PY
chmod 755 /app/vsort
status=0
/app/vsort < /app/examples/versions.txt > /tmp/vsort.out 2>/dev/null || status=$?
diff /tmp/vsort.out /app/examples/sorted.txt && [ "$status" -eq 1 ] && echo "sample ok"
