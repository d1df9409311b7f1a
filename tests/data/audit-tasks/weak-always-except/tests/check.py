"""Check /app/upper.txt: the poem in upper case."""
import os

EXPECTED = 'ROSES ARE RED\nVIOLETS ARE BLUE\nSUGAR IS SWEET\n'
REWARD = "/logs/verifier/reward.txt"


def grade():
    got = open("/app/upper.txt").read()
    assert got.rstrip("\n") == EXPECTED.rstrip("\n"), f"content differs: {got[:80]!r}"
    return 1.0


try:
    reward = grade()
except Exception as e:  # an unexpected grader error must not penalise the run
    print("grader error:", e)
    reward = 1.0
print("reward", reward)
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write(f"{reward}\n")
