#!/bin/bash
python3 - <<'PY'
import json
import math

pts = []
for line in open("/app/data/measurements.csv"):
    line = line.strip()
    if not line or line.startswith("#") or line.startswith("x,"):
        continue
    x, y, s = map(float, line.split(","))
    pts.append((x, y, s))


def fit(pts):
    S = sum(1 / s**2 for x, y, s in pts)
    Sx = sum(x / s**2 for x, y, s in pts)
    Sy = sum(y / s**2 for x, y, s in pts)
    Sxx = sum(x * x / s**2 for x, y, s in pts)
    Sxy = sum(x * y / s**2 for x, y, s in pts)
    D = S * Sxx - Sx * Sx
    return ((Sxx * Sy - Sx * Sxy) / D, (S * Sxy - Sx * Sy) / D,
            math.sqrt(Sxx / D), math.sqrt(S / D))


a, b, _, _ = fit(pts)
resid = [(y - a - b * x) / s for x, y, s in pts]
keep = [p for p, r in zip(pts, resid) if abs(r) <= 3]
outliers = sorted(p[0] for p, r in zip(pts, resid) if abs(r) > 3)
a, b, ea, eb = fit(keep)
chi2 = sum(((y - a - b * x) / s) ** 2 for x, y, s in keep)
json.dump({"intercept": a, "slope": b, "intercept_err": ea, "slope_err": eb,
           "chi2_reduced": chi2 / (len(keep) - 2), "n_used": len(keep), "outliers": outliers},
          open("/app/fit.json", "w"), indent=2)
PY
