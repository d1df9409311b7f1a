"""Graded check of /app/report.json (Q1 2024 sales report).

Gate: the file must be a JSON object, else 0. Reward = passed / 6:
  1. orders_counted
  2. total_revenue_eur (within 0.011)
  3. by_country has exactly the expected countries with the right order counts
  4. by_country revenue_eur for every country (within 0.011)
  5. by_country top_category for every country
  6. top_customers: ids, names and order exact, revenues within 0.011
"""
import json
import os

EXPECTED = {  # reference result for environment/data/* (see solution/solve.sh)
    "orders_counted": 113,
    "total_revenue_eur": 30642.57,
    "by_country": {
        "DE": {"orders": 25, "revenue_eur": 6710.69, "top_category": "books"},
        "FR": {"orders": 20, "revenue_eur": 5694.36, "top_category": "kitchen"},
        "GB": {"orders": 12, "revenue_eur": 3355.05, "top_category": "electronics"},
        "NL": {"orders": 20, "revenue_eur": 4880.74, "top_category": "garden"},
        "UNKNOWN": {"orders": 5, "revenue_eur": 1156.78, "top_category": "electronics"},
        "US": {"orders": 31, "revenue_eur": 8844.95, "top_category": "kitchen"},
    },
    "top_customers": [
        {"customer_id": "C003", "name": "Karl Martin", "revenue_eur": 3706.59},
        {"customer_id": "C002", "name": "Nora Taylor", "revenue_eur": 2931.62},
        {"customer_id": "C001", "name": "Mats Miller", "revenue_eur": 2171.4},
    ],
}
TOL = 0.011
REWARD = "/logs/verifier/reward.txt"


def close(a, b):
    return isinstance(a, (int, float)) and not isinstance(a, bool) and abs(a - b) <= TOL


def main():
    try:
        rep = json.load(open("/app/report.json"))
    except Exception as e:
        print("FAIL gate: cannot parse /app/report.json:", e)
        return 0.0
    if not isinstance(rep, dict):
        print("FAIL gate: not a JSON object")
        return 0.0
    bc = rep.get("by_country") if isinstance(rep.get("by_country"), dict) else {}
    ebc = EXPECTED["by_country"]
    same_keys = set(bc) == set(ebc) and all(isinstance(bc[c], dict) for c in bc)
    tc = rep.get("top_customers") if isinstance(rep.get("top_customers"), list) else []
    etc = EXPECTED["top_customers"]
    checks = [
        ("orders_counted", type(rep.get("orders_counted")) is int
         and rep["orders_counted"] == EXPECTED["orders_counted"]),
        ("total_revenue_eur", close(rep.get("total_revenue_eur"), EXPECTED["total_revenue_eur"])),
        ("by_country orders", same_keys and all(
            type(bc[c].get("orders")) is int and bc[c]["orders"] == ebc[c]["orders"] for c in ebc)),
        ("by_country revenue_eur", same_keys and all(
            close(bc[c].get("revenue_eur"), ebc[c]["revenue_eur"]) for c in ebc)),
        ("by_country top_category", same_keys and all(
            bc[c].get("top_category") == ebc[c]["top_category"] for c in ebc)),
        ("top_customers", len(tc) == len(etc) and all(
            isinstance(g, dict) and g.get("customer_id") == e["customer_id"]
            and g.get("name") == e["name"] and close(g.get("revenue_eur"), e["revenue_eur"])
            for g, e in zip(tc, etc))),
    ]
    for name, ok in checks:
        print(("PASS " if ok else "FAIL ") + name)
    if not same_keys:
        print("  countries reported:", sorted(bc), "expected:", sorted(ebc))
    return sum(ok for _, ok in checks) / len(checks)


reward = main()
print("reward", round(reward, 4))
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write(f"{reward:.4f}\n")
