"""Binary check of the comment-free settings."""
import os

EXPECTED = ['host = 0.0.0.0', 'port = 8080', 'workers = 4', 'log_level = info']
REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    got = [l.rstrip() for l in open("/app/settings.clean").read().splitlines()]
    while got and not got[-1]:
        got.pop()
    print("got", got)
    ok = got == EXPECTED
except OSError as e:
    print("cannot read /app/settings.clean:", e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
