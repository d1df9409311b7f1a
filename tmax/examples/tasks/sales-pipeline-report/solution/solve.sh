#!/bin/bash
python3 - <<'PY'
import csv
import json
from collections import defaultdict

D = "/app/data/"
customers = {r["customer_id"]: r for r in csv.DictReader(open(D + "customers.csv", newline=""))}
category = {r["sku"]: r["category"] for r in csv.DictReader(open(D + "products.csv", newline=""))}
fx = {r["currency"]: float(r["eur_per_unit"]) for r in csv.DictReader(open(D + "fx_rates.csv", newline=""))}

count, total = 0, 0.0
country_orders = defaultdict(int)
country_rev = defaultdict(float)
country_cat = defaultdict(lambda: defaultdict(float))
cust_rev = defaultdict(float)
for line in open(D + "orders.jsonl"):
    if not line.strip():
        continue
    o = json.loads(line)
    if o["status"] not in ("paid", "shipped"):
        continue
    if not ("2024-01-01" <= o["created_at"][:10] <= "2024-03-31"):
        continue
    rate = fx[o["currency"]]
    cid = o["customer_id"]
    country = customers[cid]["country"] if cid in customers else "UNKNOWN"
    rev = 0.0
    for it in o["items"]:
        v = it["qty"] * it["unit_price"] * rate
        rev += v
        country_cat[country][category.get(it["sku"], "uncategorized")] += v
    count += 1
    total += rev
    country_orders[country] += 1
    country_rev[country] += rev
    if cid in customers:
        cust_rev[cid] += rev

report = {
    "orders_counted": count,
    "total_revenue_eur": round(total, 2),
    "by_country": {
        c: {"orders": country_orders[c], "revenue_eur": round(country_rev[c], 2),
            "top_category": sorted(country_cat[c].items(), key=lambda kv: (-kv[1], kv[0]))[0][0]}
        for c in sorted(country_orders)
    },
    "top_customers": [
        {"customer_id": cid, "name": customers[cid]["name"], "revenue_eur": round(v, 2)}
        for cid, v in sorted(cust_rev.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    ],
}
json.dump(report, open("/app/report.json", "w"), indent=2)
PY
