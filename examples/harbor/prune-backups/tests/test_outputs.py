"""Grades /app/prune-backups by running it on backup folders generated here and comparing
what it leaves and prints with a reference computed here."""

import datetime as dt
import os
import random
import subprocess
from pathlib import Path

import pytest

PRUNE = "/app/prune-backups"
DECOYS = ["backup-2024-02-30.tar.gz", "backup-2023-02-29.tar.gz", "backup-2024-13-01.tar.gz",
          "backup-2024-04-31.tar.gz", "backup-2024-1-05.tar.gz", "backup-2024-01-05.tar",
          "backup-2024-01-05.tar.gz.partial", "old-backup-2024-01-05.tar.gz",
          "Backup-2024-01-05.tar.gz", "backup-2024-01-05.tgz", "notes.txt"]


def name(day: dt.date) -> str:
    return f"backup-{day.isoformat()}.tar.gz"


def reference(days: set[dt.date], daily: int, weekly: int) -> list[dt.date]:
    """The backups to delete, oldest first."""
    newest = sorted(days, reverse=True)
    keep = set(newest[:daily])
    weeks: list[tuple[int, int]] = []
    for day in newest:
        week = day.isocalendar()[:2]
        if week not in weeks:
            weeks.append(week)
            if len(weeks) <= weekly:
                keep.add(day)
    return sorted(days - keep)


def make_folder(root: Path, rng: random.Random) -> set[dt.date]:
    root.mkdir()
    start = dt.date(rng.randint(1998, 2030), rng.choice([1, 6, 12]), rng.randint(1, 28))
    span = rng.randint(1, 400)
    days = {start + dt.timedelta(days=rng.randrange(span)) for _ in range(rng.randint(1, 60))}
    for day in days:
        (root / name(day)).write_text(f"archive {day}\n")
    for decoy in rng.sample(DECOYS, rng.randint(0, len(DECOYS))):
        (root / decoy).write_text("not a backup\n")
    sub = root / "archive"
    sub.mkdir()
    (sub / name(start)).write_text("in a subfolder\n")
    (root / name(start - dt.timedelta(days=1))).mkdir()  # a folder with a backup's name
    return days


def listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PRUNE, *args], capture_output=True, check=False, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


def test_script_is_executable():
    assert os.access(PRUNE, os.X_OK), f"{PRUNE} is missing or not executable"


@pytest.mark.parametrize("seed", range(30))
def test_generated_folders(tmp_path, seed):
    rng = random.Random(seed)
    root = tmp_path / "backups"
    days = make_folder(root, rng)
    daily, weekly = rng.randint(0, 9), rng.randint(0, 9)
    before = listing(root)
    deleted = [name(d) for d in reference(days, daily, weekly)]
    proc = run(str(root), str(daily), str(weekly))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == deleted
    assert listing(root) == before - set(deleted)


def test_year_boundary_weeks(tmp_path):
    root = tmp_path / "b"
    root.mkdir()
    # ISO week 2025-W01 is 2024-12-30 .. 2025-01-05; 2024-W52 ends on 2024-12-29
    days = ["2024-12-22", "2024-12-28", "2024-12-29", "2024-12-30", "2025-01-01", "2025-01-05"]
    for day in days:
        (root / f"backup-{day}.tar.gz").write_text(day)
    proc = run(str(root), "0", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["backup-2024-12-22.tar.gz", "backup-2024-12-28.tar.gz",
                                   "backup-2024-12-30.tar.gz", "backup-2025-01-01.tar.gz"]
    assert sorted(p.name for p in root.iterdir()) == ["backup-2024-12-29.tar.gz",
                                                       "backup-2025-01-05.tar.gz"]


@pytest.mark.parametrize("args", [["{dir}/missing", "7", "4"], ["{dir}", "-1", "4"],
                                  ["{dir}", "7", "four"], ["{dir}", "7"]])
def test_bad_arguments_delete_nothing(tmp_path, args):
    root = tmp_path / "b"
    make_folder(root, random.Random(99))
    before = listing(root)
    proc = run(*[a.format(dir=root) for a in args])
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.strip()
    assert listing(root) == before
