import sys
from pathlib import Path

got = Path("/app/count.txt").read_text().strip() if Path("/app/count.txt").exists() else ""
sys.exit(0 if got == "9" else 1)
