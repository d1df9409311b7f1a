"""Binary check: every file of the archive is present under /app/logs with its exact content."""
import hashlib
import os

EXPECTED = {  # sha256 of each member of environment/logs.tar.gz
    "app.log": "3a39071912af40e98d85c3dd326fcd515aa7a54571727ecf96a7cb55b2ef08cc",
    "db.log": "7c19dbc2134c7d3fe1c1262fadafe029074aeaac73f3bb8421c8edbe0853c746",
    "worker/queue.log": "275114b08c165ff89ae82965e668832313d4d8708483ea21391ef00f6a476236",
}
REWARD = "/logs/verifier/reward.txt"
good = 0
for rel, digest in EXPECTED.items():
    p = os.path.join("/app/logs", rel)
    try:
        ok = hashlib.sha256(open(p, "rb").read()).hexdigest() == digest
    except OSError:
        ok = False
    print(("PASS " if ok else "FAIL ") + p)
    good += ok
reward = 1.0 if good == len(EXPECTED) else 0.0
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write(f"{reward}\n")
