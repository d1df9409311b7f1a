"""Graded check for the secret redaction.

Gate: if the leaked secret still occurs anywhere under /app/project -> reward 0.
Otherwise reward = passed / 4 over:
  1. config/settings.ini equals the expected redacted file byte for byte
  2. scripts/deploy.sh equals the expected redacted file byte for byte
  3. every other file is present and unchanged, and no file was added
  4. /app/leak.txt lists exactly the two leaking files (sorted absolute paths)
"""
import hashlib
import os

SECRET = "I0CoJI9AAjPJ20a//gyJJThX3xBMznXEQk/qHu+a"
ROOT = "/app/project"
REDACTED = {"config/settings.ini", "scripts/deploy.sh"}
UNCHANGED = {
    ".env.example": "81f69a09713b1f864901f9155be8c5b636679336bf2adad4dfdd1862630fc02d",
    "CHANGELOG.md": "4e02456a86847a410d557a6e6869dc18aad92c9cc625437425a6150d140d28fb",
    "README.md": "f136cc0e3bd939242a0f9abfc4770769e9246430cf172f2d7e893ed9610c2755",
    "config/logging.ini": "e6364c8da7b76337367e8a78c372d89244a673a782df820272226362518c3551",
    "src/billing_sync/__init__.py": "179996d3ba52c86aea0cd636121afe5290f3a41b4df85b185344066567fa3c91",
    "src/billing_sync/upload.py": "0aba3f7c28c0c629deb9e2fb40959428e86901c8e697cb6411cec1db73cb672e",
    "tests/test_upload.py": "86b1c62e7d8654640b2362bac9760d67c8777dc19ce4883feb95327f6d7678ac",
}
REWARD = "/logs/verifier/reward.txt"


def read(p):
    try:
        with open(p, "rb") as f:
            return f.read()
    except OSError:
        return None


def main():
    present = []
    for dp, dn, fn in os.walk(ROOT):
        for name in fn:
            present.append(os.path.relpath(os.path.join(dp, name), ROOT))
    leaking = [p for p in present if SECRET.encode() in (read(os.path.join(ROOT, p)) or b"")]
    if not os.path.isdir(ROOT) or leaking:
        print("FAIL gate: secret still present in", leaking or "(project missing)")
        return 0.0
    passed = 0
    for rel in sorted(REDACTED):
        exp = read(os.path.join("/tests/expected", rel.replace("/", "__")))
        ok = read(os.path.join(ROOT, rel)) == exp
        print(("PASS" if ok else "FAIL"), "redacted content of", rel)
        passed += ok
    ok = set(present) == set(UNCHANGED) | REDACTED and all(
        hashlib.sha256(read(os.path.join(ROOT, rel)) or b"").hexdigest() == d
        for rel, d in UNCHANGED.items())
    print(("PASS" if ok else "FAIL"), "other files unchanged, none added or removed")
    passed += ok
    leak = read("/app/leak.txt")
    want = "".join(f"{ROOT}/{rel}\n" for rel in sorted(REDACTED))
    ok = leak is not None and leak.decode(errors="replace").strip() + "\n" == want
    print(("PASS" if ok else "FAIL"), "/app/leak.txt:", repr((leak or b"")[:200]))
    passed += ok
    return passed / 4


reward = main()
print("reward", reward)
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write(f"{reward}\n")
