"""Graded check of /app/fit.json (weighted least squares with one outlier-rejection pass).

Reward = passed / 7 (one check per reported quantity). Floats: relative tolerance 1e-4.
Missing or invalid file -> 0.
"""
import json
import os

EXPECTED = {  # reference values for environment/data/measurements.csv
    "intercept": 2.550788949443196,
    "slope": 1.7496739188052337,
    "intercept_err": 0.11680114990338333,
    "slope_err": 0.012372489668360666,
    "chi2_reduced": 0.4947133892566966,
}
EXPECTED_N = 30
EXPECTED_OUTLIERS = [4.026, 11.962]
REWARD = "/logs/verifier/reward.txt"


def num(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


reward = 0.0
try:
    got = json.load(open("/app/fit.json"))
    assert isinstance(got, dict), "not a JSON object"
    checks = []
    for k, v in EXPECTED.items():
        x = got.get(k)
        checks.append((k, num(x) and abs(x - v) <= 1e-4 * abs(v), x))
    n = got.get("n_used")
    checks.append(("n_used", type(n) is int and n == EXPECTED_N, n))
    o = got.get("outliers")
    checks.append(("outliers", isinstance(o, list) and len(o) == len(EXPECTED_OUTLIERS)
                   and all(num(a) and abs(a - b) < 1e-9 for a, b in zip(o, EXPECTED_OUTLIERS)), o))
    for name, ok, val in checks:
        print(("PASS " if ok else "FAIL ") + name, repr(val))
    reward = sum(ok for _, ok, _ in checks) / len(checks)
except Exception as e:
    print("cannot use /app/fit.json:", e)
print("reward", round(reward, 4))
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write(f"{reward:.4f}\n")
