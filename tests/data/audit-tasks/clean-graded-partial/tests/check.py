"""Graded check of /app/answers.json: a quarter per correct key; sub-scores in reward.json."""
import json
import os

EXPECTED = {'total_requests': 90, 'unique_ips': 23, 'top_path': '/cart', 'server_errors': 19}
OUT_DIR = "/logs/verifier"
scores = {k: 0.0 for k in EXPECTED}
try:
    got = json.load(open("/app/answers.json"))
    if not isinstance(got, dict):
        raise ValueError("answers.json is not a JSON object")
    for key, want in EXPECTED.items():
        value = got.get(key)
        hit = value == want and type(value) is type(want)
        scores[key] = 1.0 if hit else 0.0
        print("PASS" if hit else "FAIL", key, repr(value), "expected", repr(want))
except (OSError, ValueError) as e:
    print("cannot grade /app/answers.json:", e)
reward = sum(scores.values()) / len(scores)
print("reward", reward)
os.makedirs(OUT_DIR, exist_ok=True)
with open(os.path.join(OUT_DIR, "reward.json"), "w") as f:
    json.dump({"reward": reward, **scores}, f)
with open(os.path.join(OUT_DIR, "reward.txt"), "w") as f:
    f.write(f"{reward}\n")
