"""Binary check of the ranking (highest score first)."""
import os

EXPECTED = ['pia', 'nia', 'oli', 'lea', 'max', 'kai', 'rex', 'quin']
REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    got = [l.strip() for l in open("/app/ranking.txt").read().splitlines() if l.strip()]
    print("got", got)
    ok = got == EXPECTED
except OSError as e:
    print("cannot read /app/ranking.txt:", e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
