"""Binary check of the letter grades."""
import os

OUT = "/app/result.csv"
EXPECTED = ['student,grade', 'ada,F', 'ben,D', 'cleo,F', 'dan,B', 'eli,C', 'fay,F', 'gus,B', 'hana,F', 'ivo,A', 'jun,B']
REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    got = [l.strip() for l in open(OUT).read().splitlines() if l.strip()]
    print(got)
    ok = got == EXPECTED
except OSError as e:
    print("cannot read", OUT, e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
