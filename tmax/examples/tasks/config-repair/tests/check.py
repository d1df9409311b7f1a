"""Graded check of the repaired /app/etc/service.json.

Gate: the file must parse with json.load into an object, else 0.
Reward = passed / 3:
  1. every other setting (all keys and values except the two changed ones) is exactly as
     the author wrote it, with no keys added or removed
  2. listen.port is the number 8443
  3. tls.enabled is true
"""
import copy
import json
import os

INTENDED = {
    "listen": {"host": "0.0.0.0", "port": 8080},
    "tls": {"enabled": False, "cert": "/app/etc/tls/server.crt",
            "key": "/app/etc/tls/server.key"},
    "workers": 4,
    "log": {"level": "info", "file": "/app/var/log/service.log"},
    "upstreams": ["http://10.0.0.11:9000", "http://10.0.0.12:9000"],
    "features": {"cache": True, "metrics": True, "beta_ui": False},
    "motd": "Maintenance window: Sundays 02:00-04:00 // see wiki",
}
REWARD = "/logs/verifier/reward.txt"


def same(a, b):
    """Deep equality that does not confuse True with 1 or 4 with 4.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def main():
    try:
        with open("/app/etc/service.json") as f:
            cfg = json.load(f)
    except Exception as e:
        print("FAIL gate: not valid JSON:", e)
        return 0.0
    if not isinstance(cfg, dict):
        print("FAIL gate: top level is not an object")
        return 0.0
    passed = 0
    rest = copy.deepcopy(cfg)
    try:
        rest["listen"]["port"] = 8080
        rest["tls"]["enabled"] = False
    except Exception:
        pass
    ok = same(rest, INTENDED)
    print(("PASS" if ok else "FAIL"), "other settings preserved")
    passed += ok
    port = cfg.get("listen", {}).get("port") if isinstance(cfg.get("listen"), dict) else None
    ok = type(port) is int and port == 8443
    print(("PASS" if ok else "FAIL"), "listen.port == 8443:", repr(port))
    passed += ok
    tls = cfg.get("tls", {}).get("enabled") if isinstance(cfg.get("tls"), dict) else None
    ok = tls is True
    print(("PASS" if ok else "FAIL"), "tls.enabled is true:", repr(tls))
    passed += ok
    return passed / 3


reward = main()
print("reward", reward)
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write(f"{reward}\n")
