"""Binary check: /app/hello.txt contains exactly 'hello world' (optional trailing newline)."""
import os

REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    with open("/app/hello.txt", "rb") as f:
        data = f.read()
    ok = data in (b"hello world", b"hello world\n")
    print("content:", repr(data[:80]))
except OSError as e:
    print("cannot read /app/hello.txt:", e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
