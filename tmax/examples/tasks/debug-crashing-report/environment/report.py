#!/usr/bin/env python3
"""Summarise request events.

usage: python3 /app/report.py EVENTS.jsonl

Prints one JSON object (keys sorted) to stdout:
    {"error_rate": <errors / events, rounded to 4 decimals>,
     "users": {<user>: {"errors": <int>, "events": <int>, "total_ms": <int>}, ...}}
"""
import json
import sys


def load(path):
    events = []
    with open(path) as f:
        for line in f:
            events.append(json.loads(line))
    return events


def summarise(events):
    users = {}
    errors = 0
    for ev in events:
        u = users.setdefault(ev["user"], {"events": 0, "total_ms": 0, "errors": 0})
        u["events"] += 1
        u["total_ms"] += ev["duration_ms"]
        if ev["status"] == "error":
            u["errors"] += 1
            errors += 1
    return {"users": users, "error_rate": round(errors / len(events), 4)}


def main():
    print(json.dumps(summarise(load(sys.argv[1])), sort_keys=True))


if __name__ == "__main__":
    main()
