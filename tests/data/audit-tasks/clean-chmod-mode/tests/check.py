"""Binary check of the two modes; both files must be unchanged, and backup.sh must run."""
import hashlib
import os
import stat
import subprocess

FILES = {  # path -> (mode, sha256 of the file as shipped)
    "/app/bin/backup.sh": (0o755, "7661fbb5b46f615bfd4aea11ad41e999b8bb930ce7fef7b1e28d9aa0772c96f5"),
    "/app/secret.key": (0o600, "a7994e3212ddb9ac6e4bcd4b09f9a8c8765cba1947ccca33871602ba6beb94b1"),
}
REWARD = "/logs/verifier/reward.txt"
ok = True
try:
    for path, (mode, digest) in FILES.items():
        st = os.lstat(path)
        got_mode = stat.S_IMODE(st.st_mode)
        same = stat.S_ISREG(st.st_mode) and hashlib.sha256(open(path, "rb").read()).hexdigest() == digest
        print(path, oct(got_mode), "expected", oct(mode), "unchanged" if same else "CHANGED")
        ok = ok and got_mode == mode and same
    run = subprocess.run(["/app/bin/backup.sh"], capture_output=True, text=True, timeout=5)
    print("backup.sh:", run.returncode, repr(run.stdout))
    ok = ok and run.returncode == 0 and run.stdout.strip() == "backup done"
except (OSError, subprocess.TimeoutExpired) as e:
    print("error:", e)
    ok = False
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
