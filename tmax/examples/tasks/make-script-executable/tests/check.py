"""Binary check: /app/run.sh is owner-executable, unchanged, and runs successfully."""
import hashlib
import os
import stat
import subprocess

SHA256 = "17135fa8ae1ca78f38e03733f8fd4047251d98251cb72a27403e2fe5308a1f32"  # digest of environment/run.sh as shipped
REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    st = os.stat("/app/run.sh")
    mode_ok = bool(st.st_mode & stat.S_IXUSR) and stat.S_ISREG(st.st_mode)
    same = hashlib.sha256(open("/app/run.sh", "rb").read()).hexdigest() == SHA256
    out = subprocess.run(["/app/run.sh"], capture_output=True, text=True, timeout=10)
    runs = out.returncode == 0 and out.stdout.strip() == "deploy ok"
    print(f"mode={oct(st.st_mode & 0o7777)} owner_exec={mode_ok} unchanged={same} runs={runs}")
    ok = mode_ok and same and runs
except Exception as e:
    print("error:", e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
