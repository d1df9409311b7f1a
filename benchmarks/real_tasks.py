"""Real public benchmark tasks, run unmodified through TMax (issue 12, "Measure and show").

    python benchmarks/real_tasks.py materialise --sources SET/SOURCES.tsv --dest SET
        (--mirror-root /work/.mirror | --clone-root DIR) [--force]
    python benchmarks/real_tasks.py measure --sources SET/SOURCES.tsv --tasks SET
        [--store /tmp/real-store] [--work /tmp/real-work] [--out SET/results.json]
        [--timeout 1800] [--jobs 1] [--only GLOB] [--no-build] [--force]
    python benchmarks/real_tasks.py report --sources SET/SOURCES.tsv --out SET/results.json

The task set lives outside the repository (SET, e.g. /work/real-tasks): its tasks are other
people's code, never committed here. ``SOURCES.tsv`` says where each came from, one task a
line: ``collection task repo commit path layout self_contained reason`` (tab-separated,
with a header), where ``layout`` is ``harbor`` (instruction.md, task.toml,
environment/Dockerfile, tests/test.sh, solution/solve.sh) or ``tb1`` (task.yaml, Dockerfile,
run-tests.sh, tests/, solution.sh), and ``self_contained`` is yes/no with the reason (no GPU,
no custom prebuilt image, no internet needed while the agent works).

materialise
    Copies each task's folder, byte for byte (modes and symlinks kept), from a git
    repository at the recorded commit to ``DEST/<collection>/<task>/``. The repositories
    come from ``--mirror-root`` (bare snapshots laid out as ``<owner>+<name>/repo``, as the
    search tool's ``fetch`` leaves them under /work/.mirror) or ``--clone-root`` (any git
    clones, as ``<owner>+<name>``, ``<owner>/<name>`` or ``<name>``; one that is missing
    is cloned from GitHub there, where the network allows it).

measure
    For each task, unmodified:
    1. validate: Harbor tasks with ``tmax tasks validate``; TB1 tasks with ``tmax tasks
       convert`` (the documented path for that layout, which validates what it writes);
    2. build: ``tmax images build`` with its build-time checks (the image starts, the
       untouched environment scores below 1, the reference solution scores 1), one task
       per call, under ``--timeout`` (the call's process group is killed past it), into
       ``--store``;
    3. classify: the first thing that stopped the task (a validate error, an unmapped FROM
       base, a build step, a verifier that needs the network, oracle < 1, nop == 1, a
       timeout ...).
    Results go to ``--out`` (JSON, rewritten after every task); a task already there is
    skipped unless ``--force`` (so an interrupted run resumes). ``--jobs`` tasks at a time
    (default 1: builds are CPU-bound and this machine is shared).

report
    Prints the tables of a results file: per collection (validate / build / oracle 1 /
    nop < 1 / all four), the self-contained subset, and the failures by cause with
    examples.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import fnmatch
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("real_tasks")
REPO = Path(__file__).resolve().parents[1]
FIELDS = ["collection", "task", "repo", "commit", "path", "layout", "self_contained", "reason"]


# --------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class Source:
    collection: str
    task: str
    repo: str
    commit: str
    path: str
    layout: str
    self_contained: bool
    reason: str

    @property
    def id(self) -> str:
        return f"{self.collection}/{self.task}"


def read_sources(path: Path) -> list[Source]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    if rows and set(FIELDS) - set(rows[0]):
        raise SystemExit(f"{path}: columns must be {FIELDS}, got {list(rows[0])}")
    out = []
    for i, r in enumerate(rows, start=2):
        if r["layout"] not in ("harbor", "tb1"):
            raise SystemExit(f"{path}:{i}: layout must be harbor or tb1, not {r['layout']!r}")
        if r["self_contained"] not in ("yes", "no"):
            raise SystemExit(f"{path}:{i}: self_contained must be yes or no")
        out.append(Source(**{k: r[k] for k in FIELDS if k != "self_contained"},
                          self_contained=r["self_contained"] == "yes"))
    ids = Counter(s.id for s in out)
    if dup := [i for i, n in ids.items() if n > 1]:
        raise SystemExit(f"{path}: duplicate tasks {dup}")
    return out


# --------------------------------------------------------------------------- materialise


def git(git_dir: Path, *args: str, input: bytes | None = None, timeout: float = 300) -> bytes:
    proc = subprocess.run(["git", f"--git-dir={git_dir}", *args], input=input,
                          capture_output=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {proc.stderr.decode(errors='replace')}")
    return proc.stdout


def find_git_dir(repo: str, mirror_root: Path | None, clone_root: Path | None) -> Path:
    owner, name = repo.split("/", 1)
    candidates = []
    if mirror_root:
        candidates.append(mirror_root / f"{owner}+{name}" / "repo")
    if clone_root:
        for d in (clone_root / f"{owner}+{name}", clone_root / owner / name, clone_root / name):
            candidates += [d / ".git", d]
    for c in candidates:
        if (c / "HEAD").is_file() and (c / "objects").is_dir():
            return c
    if clone_root:
        dest = clone_root / f"{owner}+{name}"
        log.info("cloning %s into %s", repo, dest)
        proc = subprocess.run(["git", "clone", "--bare", f"https://github.com/{repo}",
                               str(dest)], capture_output=True, text=True, timeout=3600,
                              check=False)
        if proc.returncode != 0:
            raise SystemExit(f"{repo}: git clone failed: {proc.stderr.strip()[-300:]}")
        return dest
    raise SystemExit(f"{repo}: no git repository under {mirror_root} (fetch it first, or "
                     "pass --clone-root)")


def materialise_one(src: Source, git_dir: Path, dest: Path) -> int:
    """Write the tree at ``src.commit:src.path`` to ``dest``; returns the file count."""
    prefix = src.path.rstrip("/") + "/"
    listing = git(git_dir, "ls-tree", "-r", "-z", "--full-tree", src.commit, "--", src.path)
    entries = [e for e in listing.split(b"\0") if e]
    if not entries:
        raise RuntimeError(f"{src.repo}@{src.commit[:12]}: no files under {src.path!r}")
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    count = 0
    for entry in entries:
        meta, _, rel = entry.decode().partition("\t")
        mode, kind, sha = meta.split()
        if not rel.startswith(prefix):
            continue
        target = tmp / rel[len(prefix):]
        target.parent.mkdir(parents=True, exist_ok=True)
        if kind != "blob":  # a submodule: its files are another repository's
            log.warning("%s: skipping %s %s", src.id, kind, rel)
            continue
        data = git(git_dir, "cat-file", "blob", sha)
        if mode == "120000":
            target.symlink_to(data.decode())
        else:
            target.write_bytes(data)
            target.chmod(0o755 if mode == "100755" else 0o644)
        count += 1
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return count


def selected(sources: list[Source], only: list[str] | None) -> list[Source]:
    return [s for s in sources if not only or any(fnmatch.fnmatch(s.id, g) for g in only)]


def cmd_materialise(args) -> None:
    failed = []
    for src in selected(read_sources(args.sources), args.only):
        dest = args.dest / src.collection / src.task
        if dest.exists() and not args.force:
            print(f"have  {src.id}")
            continue
        try:
            git_dir = find_git_dir(src.repo, args.mirror_root, args.clone_root)
            n = materialise_one(src, git_dir, dest)
        except (RuntimeError, OSError, subprocess.TimeoutExpired, SystemExit) as e:
            # a missing snapshot or a file the snapshot lacks: this task only
            shutil.rmtree(dest.with_name(dest.name + ".part"), ignore_errors=True)
            failed.append(src.id)
            print(f"FAILED {src.id}: {str(e).strip()[:300]}")
            continue
        print(f"wrote {src.id}: {n} files from {src.repo}@{src.commit[:12]}:{src.path}")
    if failed:
        raise SystemExit(f"{len(failed)} tasks not materialised: {', '.join(failed)}")


# --------------------------------------------------------------------------- running tmax


def run(argv: list[str], timeout: float) -> tuple[int | None, str, str, float]:
    """argv in its own process group; past ``timeout`` the group is killed (TERM, then
    KILL). Returns (exit code or None on timeout, stdout, stderr, seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        with_group(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            with_group(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        code = None
    return code, out or "", err or "", round(time.monotonic() - start, 1)


def with_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def parse_json(text: str) -> dict | None:
    start = text.find("{")
    if start < 0:
        return None
    try:
        return json.loads(text[start:])
    except ValueError:
        return None


def problems_of(items: list[dict]) -> tuple[list[dict], list[dict]]:
    problems = [p for item in items for p in item.get("problems", [])]
    return ([p for p in problems if p.get("severity") == "error"],
            [p for p in problems if p.get("severity") != "error"])


def validate(src: Source, task_dir: Path, work: Path, tmax: str) -> dict:
    """Unmodified: Harbor tasks as they are; TB1 tasks through ``tmax tasks convert``."""
    if src.layout == "harbor":
        code, out, err, secs = run([tmax, "tasks", "validate", "-o", "json", str(task_dir)], 300)
        report = parse_json(out) or {}
        errors, warnings = problems_of(report.get("tasks", []))
        ok = code == 0 and bool(report.get("ok"))
        if not ok and not errors:
            errors = [{"file": "", "field": "", "message": (err or out).strip()[-500:]}]
        return {"step": "validate", "ok": ok, "rc": code, "seconds": secs, "errors": errors,
                "warnings": warnings, "native": str(task_dir) if ok else None}
    dest = work / "native" / src.collection
    dest.mkdir(parents=True, exist_ok=True)
    code, out, err, secs = run([tmax, "tasks", "convert", "-o", "json", "--force", "-d",
                                str(dest), str(task_dir)], 300)
    report = parse_json(out) or {}
    items = report.get("converted", [])
    errors, warnings = problems_of([i for i in items if not i.get("ok")])
    _, warnings_ok = problems_of([i for i in items if i.get("ok")])
    ok = code == 0 and bool(items) and all(i.get("ok") for i in items)
    if not ok and not errors:
        errors = [{"file": "", "field": "", "message": (err or out).strip()[-500:]}]
    native = items[0].get("path") if ok else None
    return {"step": "convert", "ok": ok, "rc": code, "seconds": secs, "errors": errors,
            "warnings": warnings + warnings_ok, "native": native}


def build(native: str, store: Path, builder: str, timeout: float, tmax: str) -> dict:
    code, out, err, secs = run([tmax, "images", "build", "--store", str(store), "--builder",
                                builder, "-j", "1", "-o", "json", native], timeout)
    report = parse_json(out)
    result = (report or {}).get("results", [{}])[0] if report else {}
    return {"rc": code, "timed_out": code is None, "seconds": secs,
            "status": result.get("status", "timeout" if code is None else "error"),
            "error": result.get("error") or ("" if report else (err or out).strip()[-2000:]),
            "log": result.get("log", ""), "checks": result.get("checks"),
            "digest": result.get("digest", "")}


# --------------------------------------------------------------------------- classify

WGET_NET = re.compile(r"RUN .*\bwget\b.*(?:https?|ftp)://[^\s/]+.*\n.*failed with exit 4")
"""A build step's wget that could not reach its host (exit status 4: network failure)."""
NET = re.compile(r"Could not resolve host|Temporary failure in name resolution|"
                 r"UnknownHostException|"
                 r"Temporary failure resolving|"
                 r"Name or service not known|Network is unreachable|Failed to connect|"
                 r"Could not connect|getaddrinfo|Connection refused|No address associated",
                 re.IGNORECASE)


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def validate_key(p: dict) -> str:
    """A short, groupable name for one validate/convert error."""
    msg = re.sub(r"\s+", " ", p.get("message", "")).strip()
    msg = re.sub(r"(?<![\w.'])/[\w./+-]+", "PATH", msg)[:90]
    where = p.get("field") or p.get("file") or ""
    return f"{where}: {msg}" if where else msg


def build_cause(b: dict, store: Path) -> tuple[str, str]:
    """(cause, detail) of a failed build."""
    err = b["error"] or ""
    if b["timed_out"]:
        return "timeout (harness --timeout)", f"after {b['seconds']}s"
    if m := re.search(r"no local base for image '([^']*)'", err):
        return "unmapped FROM base", m.group(1)
    if "timed out after" in err:
        return "build timeout (task build_timeout_sec)", err.splitlines()[0][:200]
    step = re.match(r"Dockerfile line \d+: (\w+)", err)
    if err.startswith("%files") or (step and step.group(1) in ("COPY", "ADD")) or \
            (not step and "COPY" in err[:80]):
        return "COPY/%files source", err.splitlines()[0][:200]
    if err.startswith("Dockerfile line") and not step:
        return "Dockerfile not supported", err.splitlines()[0][:200]
    log_text = tail(store / b["log"]) if b.get("log") else ""
    text = err + "\n" + log_text
    if err.startswith(("%post", "Dockerfile line")) or "exit " in err[:40]:
        if "setgroups" in text or "Method http has died" in text:
            return "build step failed: apt sandbox (setgroups)", last_line(text, "setgroups")
        if NET.search(text):
            return "build step failed: needs a non-registry host", last_line(text, NET)
        if WGET_NET.search(text):  # wget -q says nothing: its exit status 4 is the network's
            return "build step failed: needs a non-registry host", last_line(text, "wget")
        if re.search(r"not found|No such file", text):
            return "build step failed: command/file not found", last_line(text, "not found")
        return "build step failed: other", err.splitlines()[-1][:200] if err else ""
    if "Unable to locate package" in text or "E: " in text:
        return "build step failed: apt", last_line(text, "E: ")
    first = err.splitlines()[0][:200] if err else "(no message)"
    return "build error: " + re.sub(r"(?<![\w.'])/[\w./+-]+", "PATH", first)[:80], first


def last_line(text: str, pattern) -> str:
    rx = pattern if isinstance(pattern, re.Pattern) else re.compile(re.escape(pattern))
    hits = [line.strip() for line in text.splitlines() if rx.search(line)]
    return (hits[-1] if hits else text.strip().splitlines()[-1] if text.strip() else "")[:200]


BOILERPLATE_NET = re.compile(r"astral\.sh|deb\.debian\.org|security\.debian\.org|"
                             r"Some index files failed|archive\.ubuntu\.com")
"""Network errors of the verifier boilerplate (apt-get update, the uv installer) that the
prepared verifier tools make harmless."""


def _not_boilerplate(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not BOILERPLATE_NET.search(line))


def checks_window(log_text: str, head: int = 30000, end: int = 10000) -> str:
    """The checks log from its oracle section on (where there is one), its start and its
    end: a long untouched-environment section, or a long verifier output, must not push
    the solution's own output (e.g. a failed download) out of what is read."""
    at = log_text.find("## oracle in sandbox")
    part = log_text[at:] if at >= 0 else log_text
    return part if len(part) <= head + end else part[:head] + "\n...\n" + part[-end:]


def checks_cause(checks: dict, store: Path) -> tuple[str, str]:
    reason = checks.get("reason", "")
    log_text = checks_window(tail(store / checks["log"], 400000)) if checks.get("log") else ""
    oracle, nop = checks.get("oracle_reward"), checks.get("nop_reward")
    if reason.startswith("image does not start"):
        return "image does not start", reason[:200]
    if reason.startswith("sandbox failed"):
        return "sandbox failed during checks", reason[:200]
    if reason.startswith("verifier:"):
        if NET.search(_not_boilerplate(log_text)):
            return "verifier needs network at grade time", last_line(log_text, NET)
        return "verifier error (no reward)", reason[:200]
    if nop is not None and nop >= 1.0:
        return "nop == 1 (passes untouched)", reason[:200]
    if oracle != 1.0:
        oracle_part = log_text.split("## oracle", 1)[-1]
        solution_part, _, verifier_part = oracle_part.partition("$ verify:")
        if NET.search(solution_part):  # first: the verifier's boilerplate fails harmlessly
            return "oracle < 1: the solution needs the network", \
                last_line(solution_part, NET)
        if NET.search(_not_boilerplate(verifier_part)):
            return "verifier needs network at grade time (oracle < 1)", \
                last_line(verifier_part, NET)
        if re.search(r"command not found|: not found|No module named", oracle_part):
            return "oracle < 1: missing tool in image", \
                last_line(oracle_part, re.compile(r"command not found|: not found|"
                                                  r"No module named"))
        if "could not be prepared offline" in reason:
            return "oracle < 1: the verifier needs what the image lacks", reason[:300]
        return "oracle < 1: other", reason[:200]
    return "checks failed: other", reason[:200]


def classify(rec: dict, store: Path) -> None:
    v = rec["validate"]
    if not v["ok"]:
        keys = [validate_key(p) for p in v["errors"]] or ["(no message)"]
        other = [k for k in keys if "unknown key" not in k]
        what = "task.toml" if v["step"] == "validate" else "task.yaml"
        rec["cause"] = f"{v['step']}: {other[0]}" if other else \
            f"{v['step']}: {what} keys rejected (unknown key)"
        rec["detail"], rec["error_keys"] = "; ".join(other + [k for k in keys
                                                            if k not in other])[:600], keys
        return
    b = rec.get("build")
    if b is None:
        rec["cause"], rec["detail"] = "not built (--no-build)", ""
        return
    if b["status"] not in ("built", "cached", "reused"):
        rec["cause"], rec["detail"] = build_cause(b, store)
        return
    silent = [line.strip()[:160] for line in tail(store / b["log"], 200000).splitlines()
              if re.match(r"E: |.*: (command )?not found$", line.strip())] if b.get("log") else []
    rec["build_silent_errors"] = silent  # errors in a build that "succeeded" (issue 12, 4)
    checks = b.get("checks")
    if checks is None:
        rec["cause"], rec["detail"] = "built, not checked", ""
    elif not checks.get("ok"):
        rec["cause"], rec["detail"] = checks_cause(checks, store)
    elif checks.get("note"):
        rec["cause"], rec["detail"] = "built, oracle not checked (no solution)", checks["note"]
    else:
        rec["cause"], rec["detail"] = "ok", ""


def outcome(rec: dict) -> dict[str, bool]:
    b, checks = rec.get("build") or {}, (rec.get("build") or {}).get("checks") or {}
    built = b.get("status") in ("built", "cached", "reused")
    oracle1 = built and checks.get("oracle_reward") == 1.0
    nop_lt1 = built and checks.get("nop_reward") is not None and checks["nop_reward"] < 1.0
    # "all ok" means oracle 1 and nop < 1: an image whose oracle was not checked (a task
    # without a reference solution) builds and is usable, but is not counted as ok here
    return {"validate": rec["validate"]["ok"], "build": built, "oracle1": oracle1,
            "nop_lt1": nop_lt1, "all": built and bool(checks.get("ok")) and oracle1}


# --------------------------------------------------------------------------- measure


class Results:
    """The results file: one record per task id, rewritten atomically after each task."""

    def __init__(self, path: Path):
        self.path, self.lock = path, threading.Lock()
        self.data = json.loads(path.read_text()) if path.exists() else {"tasks": {}}

    def put(self, rec: dict) -> None:
        with self.lock:
            self.data["tasks"][rec["id"]] = rec
            self.data["updated_at"] = now()
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=2) + "\n")
            tmp.replace(self.path)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def tmax_version() -> str:
    def out(*a):
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True,
                              timeout=30, check=False).stdout.strip()
    dirty = " (+ uncommitted changes)" if out("status", "--porcelain", "--", "tmax") else ""
    return out("rev-parse", "--short=12", "HEAD") + dirty


def measure_one(src: Source, args, results: Results) -> dict:
    task_dir = args.tasks / src.collection / src.task
    rec = {"id": src.id, "collection": src.collection, "task": src.task, "layout": src.layout,
           "self_contained": src.self_contained, "reason": src.reason,
           "source": f"{src.repo}@{src.commit}:{src.path}", "measured_at": now(),
           "tmax": args.tmax_version}
    if not task_dir.is_dir():
        raise SystemExit(f"{task_dir}: missing (run `materialise` first)")
    rec["validate"] = validate(src, task_dir, args.work, args.tmax)
    if rec["validate"]["ok"] and not args.no_build:
        rec["build"] = build(rec["validate"]["native"], args.store, args.builder,
                             args.timeout, args.tmax)
    classify(rec, args.store)
    rec["outcome"] = outcome(rec)
    results.put(rec)
    b = rec.get("build") or {}
    print(f"{src.id:60} {rec['cause'][:70]:70} {b.get('seconds', 0):7.1f}s", flush=True)
    return rec


def cmd_measure(args) -> None:
    sources = selected(read_sources(args.sources), args.only)
    args.store.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    args.tmax_version = args.label or tmax_version()
    results = Results(args.out)
    results.data.setdefault("runs", []).append({"started_at": now(), "tmax": args.tmax_version,
                                                "store": str(args.store),
                                                "pythonpath": os.environ.get("PYTHONPATH", ""),
                                                "timeout_s": args.timeout,
                                                "jobs": args.jobs})
    todo = [s for s in sources if args.force or s.id not in results.data["tasks"]]
    print(f"# {len(sources)} tasks, {len(sources) - len(todo)} already measured; "
          f"tmax {args.tmax_version}; store {args.store}", flush=True)
    start = time.monotonic()
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(lambda s: measure_one(s, args, results), todo))
    results.data["runs"][-1]["seconds"] = round(time.monotonic() - start, 1)
    results.put(results.data["tasks"][todo[-1].id]) if todo else None
    print_report(results.data, sources)


# --------------------------------------------------------------------------- report


def print_report(data: dict, sources: list[Source]) -> None:
    # the marks (self-contained or not, and why) are SOURCES.tsv's as it is now, not as
    # they were when a task was measured
    recs = [{**data["tasks"][s.id], "self_contained": s.self_contained, "reason": s.reason}
            for s in sources if s.id in data["tasks"]]
    if not recs:
        print("no results")
        return
    cols = ["validate", "build", "oracle1", "nop_lt1", "all"]
    heads = ["validate", "build", "oracle=1", "nop<1", "all ok"]

    def row(name: str, rs: list[dict]) -> str:
        n = len(rs)
        cells = [f"{sum(r['outcome'][c] for r in rs):>3}/{n:<3}" for c in cols]
        return f"{name:30} {n:>3}  " + "  ".join(f"{c:>8}" for c in cells)

    print(f"\n{'collection (layout)':30} {'n':>3}  " + "  ".join(f"{h:>8}" for h in heads))
    by = defaultdict(list)
    for r in recs:
        by[f"{r['collection']} ({r['layout']})"].append(r)
    for name, rs in by.items():
        print(row(name, rs))
    print(row("all tasks", recs))
    for layout in ("harbor", "tb1"):
        if rs := [r for r in recs if r["layout"] == layout]:
            print(row(f"  layout {layout}", rs))
    sc = [r for r in recs if r["self_contained"]]
    print(row("self-contained", sc))
    print("\nfirst failure by cause (all tasks / self-contained), examples:")
    causes = defaultdict(list)
    for r in recs:
        if r["cause"] != "ok":
            causes[r["cause"]].append(r)
    for cause, rs in sorted(causes.items(), key=lambda kv: -len(kv[1])):
        ex = ", ".join(r["id"] + (f" [{r['detail'][:60]}]" if r["detail"] else "")
                       for r in rs[:3])
        print(f"  {len(rs):>3} / {sum(r['self_contained'] for r in rs):>3}  {cause}\n"
              f"             e.g. {ex}")
    silent = [r for r in recs if r.get("build_silent_errors")]
    if silent:
        print(f"\nbuilt, but the build log shows failed commands: {len(silent)} of "
              f"{sum(r['outcome']['build'] for r in recs)} built images")
        for r in silent:
            print(f"  {r['id']}: {len(r['build_silent_errors'])} lines, e.g. "
                  f"{r['build_silent_errors'][0][:90]}")
    bases = Counter(r["detail"].strip() for r in recs if r["cause"] == "unmapped FROM base")
    if bases:
        print("\nunmapped FROM images:")
        for image, n in bases.most_common():
            print(f"  {n:>3}  {image}")
    keys = Counter(k for r in recs for k in r.get("error_keys", []))
    if keys:
        print("\nvalidate/convert errors, by how many tasks each blocks:")
        for k, n in keys.most_common():
            print(f"  {n:>3}  {k}")


def cmd_report(args) -> None:
    """Re-classifies every record (the classifier may have learnt since) and prints."""
    data = json.loads(args.out.read_text())
    store = args.store or Path(data.get("runs", [{}])[-1].get("store", "/tmp/real-store"))
    for rec in data["tasks"].values():
        classify(rec, store)
        rec["outcome"] = outcome(rec)
    if args.save:
        args.out.write_text(json.dumps(data, indent=2) + "\n")
    print_report(data, read_sources(args.sources))


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("materialise", help="copy the tasks out of their repositories")
    m.add_argument("--sources", type=Path, required=True)
    m.add_argument("--dest", type=Path, required=True)
    m.add_argument("--mirror-root", type=Path, help="bare snapshots <owner>+<name>/repo")
    m.add_argument("--clone-root", type=Path, help="git clones (missing ones are cloned)")
    m.add_argument("--force", action="store_true", help="rewrite tasks already there")
    m.add_argument("--only", action="append", help="task id glob (collection/task); repeat")
    r = sub.add_parser("measure", help="validate, build and check every task")
    r.add_argument("--sources", type=Path, required=True)
    r.add_argument("--tasks", type=Path, required=True, help="the materialised set")
    r.add_argument("--store", type=Path, default=Path("/tmp/real-store"))
    r.add_argument("--work", type=Path, default=Path("/tmp/real-work"),
                   help="converted (native) copies of TB1 tasks go here")
    r.add_argument("--out", type=Path, default=None, help="results JSON [TASKS/results.json]")
    r.add_argument("--timeout", type=float, default=1800, help="seconds per task build")
    r.add_argument("--jobs", type=int, default=1, help="tasks measured at once")
    r.add_argument("--builder", default="auto", choices=["auto", "apptainer", "local"])
    r.add_argument("--only", action="append", help="task id glob (collection/task); repeat")
    r.add_argument("--no-build", action="store_true", help="validate only")
    r.add_argument("--force", action="store_true", help="measure tasks already in --out")
    r.add_argument("--label", help="what tmax is measured (e.g. 'before: 2feaf7a'); "
                   "default: this checkout's commit")
    r.add_argument("--tmax", default=str(Path(sys.executable).parent / "tmax"),
                   help="the tmax command [next to this Python]")
    s = sub.add_parser("report", help="print the tables of a results file")
    s.add_argument("--sources", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--store", type=Path, help="the store the run used [from the file]")
    s.add_argument("--save", action="store_true", help="write the re-classified records back")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.cmd == "materialise":
        if not (args.mirror_root or args.clone_root):
            p.error("materialise needs --mirror-root or --clone-root")
        cmd_materialise(args)
    elif args.cmd == "measure":
        args.out = args.out or args.tasks / "results.json"
        if not Path(args.tmax).exists() and not shutil.which(args.tmax):
            p.error(f"no tmax command at {args.tmax} (pass --tmax)")
        cmd_measure(args)
    else:
        cmd_report(args)


if __name__ == "__main__":
    main()
