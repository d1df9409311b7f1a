"""The sealed local runtime against the one before it (issue 11): sandbox start, lease
acquire and exec, both implementations measured in one run, interleaved in blocks so a slow
spell of the machine hits both alike; then where the new start's time goes.

    .venv/bin/python benchmarks/seal_bench.py [--image IMAGE.sif] [--old-rev 2dfe18e]
        [--new-rev HEAD | --new-tree .] [--helper CANDIDATE/helper.py] [--rounds 4]
        [--cold 2] [--warm 5] [--fleet-cold 2] [--fleet-warm 5] [--rt-exec 15]
        [--rt-exec-idle 4] [--exec 150] [--profile 5] [--micro 5] [--out FILE.json]

Three to five minutes with the defaults on 2 busy cores (the old cold starts, a full
unsquashfs each, take most of it); ``--max-s`` bounds the rounds.

Run as root (both runtimes need it). Each implementation runs from a git worktree of its
revision, made under /tmp and removed at the end (``--old-rev``, ``--new-rev``: HEAD when
the run starts, so commits landing meanwhile do not mix in; ``--old-tree``/``--new-tree``
name a checkout instead, ``--new-tree .`` for uncommitted work), in an agent process of
its own (this script, ``agent``) whose ``sandfleet`` is that tree's, so imports never
mix. Every figure is taken inside the agents; the parent only schedules blocks (old and
new alternate, the order flips every round) and prints. Everything lives under one fresh /tmp folder (state, caches, fleets,
hard links of the image), under the owner ``sealbench``, and is removed at the end.

What is measured, per implementation:

- ``rt_cold``: ``runtime.start`` + the first ``exec(["true"])`` of an image the node has
  never seen: a fresh runtime with a fresh cache dir and a fresh hard link of the image
  (its own path: a new cache key before, a new name now), nothing of it running. The
  page cache is *not* dropped (no sysctl writes): the SIF's pages stay in memory.
- ``rt_warm``: the same image again, nothing of it running (old: root already unpacked;
  new: the image's loop device has gone with the last sandbox, so it is mounted afresh).
- ``rt_warm_shared``: the same while another sandbox of the image runs (new: ``mount -o
  loop`` reuses that sandbox's loop device and squashfs superblock, caches included).
- ``fleet_cold`` / ``fleet_warm``: lease acquire through a real local fleet (controller +
  one worker, ``sandfleet up``) of a never-seen image / of the image a held lease runs.
- ``rt_exec``: one ``runtime.exec(["true"])`` in a running sandbox, back to back: a fresh
  entry process each (nsenter before, ``python3 -I -S helper.py enter`` now); copy_in,
  copy_out and the shell's start go this way. ``rt_exec_idle``: the same after 0.2 s of
  quiet, as in an episode (a cgroup v1 join after a quiet spell waits for an RCU grace
  period, which back-to-back joins share).
- ``lease_exec``: ``lease.run("true")``, the exec round trip through the lease's one
  long-lived shell (the issue's "must not regress by more than 10%").

Then (new only) ``--profile`` instrumented cold starts: the helper runs through a wrapper
that timestamps each seal and enter step (CLOCK_MONOTONIC, shared by all processes), the
runtime's own steps are timestamped in the agent; plus micro-timings of Python start-up,
mkfs.ext4 and loop mounts on their own.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from common import emit, machine  # benchmarks/common.py (scripts run from benchmarks/)
from sandfleet_bench import fleet_down, fleet_up, summary, timed

log = logging.getLogger("seal_bench")
REPO = Path(__file__).resolve().parents[1]
OWNER = "sealbench"
STORE = Path(os.environ.get("TMAX_TEST_CACHE", Path.home() / ".cache" / "tmax")) / "test-store"
FLEET = {"min_nodes": 1, "max_nodes": 1, "cpus_per_node": 8, "memory_mb_per_node": 16384}
"""Keys both implementations' FleetConfig accept."""
OPS = ("rt_cold", "fleet_cold", "rt_warm", "rt_warm_shared", "fleet_warm", "rt_exec",
       "rt_exec_idle", "lease_exec")
"""One block of each per round, in this order: the cold ones while nothing of the base
image runs, the shared/exec ones while the agent's long-lived sandbox and lease run."""
WHAT = {
    "rt_cold": "runtime.start + first exec(true), image never seen (fresh cache, new path)",
    "rt_warm": "runtime.start + first exec(true), image seen before, none of it running",
    "rt_warm_shared": "runtime.start + first exec(true), another sandbox of it running",
    "fleet_cold": "lease acquire, image never seen on the node",
    "fleet_warm": "lease acquire, image seen (a lease of it held)",
    "rt_exec": "runtime.exec(true) back to back: one entry process each (copy_in/out)",
    "rt_exec_idle": "runtime.exec(true) after 0.2 s idle (cgroup v1 joins pay an RCU "
                    "grace period then)",
    "lease_exec": "lease.run(true): exec round trip through the lease's shell",
}


# ---- the agent: one implementation, driven over a pipe


TIMED_HELPER = '''\
import os, sys, time
_fd = os.open({log!r}, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
def ev(name):
    os.write(_fd, ("%d %s %.6f\\n" % (os.getpid(), name, time.monotonic())).encode())
ev("python up")
HELPER = {helper!r}
ns = {{"__name__": "helper", "__file__": HELPER}}
if HELPER.endswith(".pyc"):  # a compiled candidate (--helper): as python runs one
    import marshal
    with open(HELPER, "rb") as f:
        exec(marshal.loads(f.read()[16:]), ns)
else:
    with open(HELPER) as f:
        exec(compile(f.read(), HELPER, "exec"), ns)  # as ``python helper.py`` compiles it
ev("helper loaded")
def wrap(name):
    fn = ns[name]
    def timed(*args, **kwargs):
        ev(name + "<")
        try:
            return fn(*args, **kwargs)
        finally:
            ev(name + ">")
    ns[name] = timed
for name in ("private_mount_namespace", "mapping_userns", "idmapped_bind", "make_disk",
             "no_nested_userns", "drop_capabilities", "enter"):
    if name in ns:  # what this version of helper.py has
        wrap(name)
_run = ns.get("run")  # the seal's tool runs (mount, mkfs.ext4)
def run(argv):
    what = " ".join(argv[:3] if argv[0] == "mount" else argv[:1])
    ev(what + "<")
    try:
        return _run(argv)
    finally:
        ev(what + ">")
if _run is not None:
    ns["run"] = run
_os_execvpe = os.execvpe
def os_execvpe(file, args, env):
    ev("exec " + os.path.basename(file))
    _os_execvpe(file, args, env)
os.execvpe = os_execvpe
if "execvpe" in ns:  # its own PATH search: execvpe(argv, env)
    _execvpe = ns["execvpe"]
    def execvpe(argv, env):
        ev("exec " + os.path.basename(argv[0]))
        _execvpe(argv, env)
    ns["execvpe"] = execvpe
ns["main"]()
'''
"""helper.py run through timestamps: the same code and arguments, each step logged."""


class Agent:
    """One implementation's runtime, fleet, long-lived sandbox and lease."""

    def __init__(self, impl: str, root: Path, image: Path):
        from sandfleet.runtime.base import SandboxSpec
        from sandfleet.runtime.local import LocalRuntime

        self.impl, self.root, self.image = impl, root, image
        self.Spec, self.Runtime = SandboxSpec, LocalRuntime
        self.cold_n = 0
        self.runtime = LocalRuntime(root / "rt-state", root / "rt-cache", owner=OWNER)
        self.state: Path | None = None
        self.fleet = self.lease = None
        self.shared_up = False
        self.unpack: list[float] = []  # old: seconds in sif.extract, per cold start
        if impl == "new" and os.environ.get("SEAL_BENCH_HELPER"):  # --helper
            from sandfleet.runtime import local

            local.HELPER = Path(os.environ["SEAL_BENCH_HELPER"])
        if impl == "old":
            from sandfleet.runtime import local

            extract = local.sif.extract

            def timed_extract(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return extract(*args, **kwargs)
                finally:
                    self.unpack.append(time.perf_counter() - t)
            local.sif.extract = timed_extract

    # -- setup and teardown

    def fleet_start(self) -> dict:
        from sandfleet.client import FleetClient

        self.state = fleet_up(self.root / "fleet", cache_dir=str(self.root / "fleet-cache"),
                              work_dir=str(self.root / "fleet-work"), **FLEET)
        self.fleet = FleetClient(self.state)
        deadline = time.monotonic() + 60
        while not self.fleet.status()["nodes"]:
            if time.monotonic() > deadline:
                raise RuntimeError("the fleet's worker did not register in 60 s")
            time.sleep(0.2)
        self.fleet.acquire(self.image).release()  # old: unpacks the base into its cache
        self.runtime.start("prime", self.Spec(image=self.image))
        self.runtime.stop("prime")
        return {}

    def close(self) -> dict:
        problems = []
        for step in (self.shared_down, lambda: self.fleet and self.fleet.close(),
                     lambda: self.state and fleet_down(self.state),
                     lambda: self.runtime.reap(())):
            try:
                step()
            except Exception as e:  # noqa: BLE001 - reported, the rest still runs
                problems.append(f"{type(e).__name__}: {e}")
        return {"problems": problems}

    def shared_upd(self) -> None:
        if not self.shared_up:
            self.runtime.start("shared", self.Spec(image=self.image))
            self.lease = self.fleet.acquire(self.image)
            self.shared_up = True

    def shared_down(self) -> None:
        if self.shared_up:
            self.shared_up = False
            self.runtime.stop("shared")
            self.lease.release()
            time.sleep(0.3)  # the worker stops it after replying

    def fresh_image(self) -> Path:
        """A hard link of the image under a name never used: an image the node has not seen
        (a copy where /tmp is another file system)."""
        self.cold_n += 1
        path = self.root / "images" / f"cold-{self.cold_n}.sif"
        path.parent.mkdir(exist_ok=True)
        try:
            os.link(self.image, path)
        except OSError:
            shutil.copyfile(self.image, path)
        return path

    # -- measured blocks: each returns {series: [seconds, ...]}

    def start_exec_stop(self, runtime, sid: str, image: Path) -> dict[str, float]:
        t0 = time.perf_counter()
        runtime.start(sid, self.Spec(image=image))
        t1 = time.perf_counter()
        result = runtime.exec(sid, ["true"], timeout=30)
        t2 = time.perf_counter()
        runtime.stop(sid)
        t3 = time.perf_counter()
        if result.exit_code != 0:
            raise RuntimeError(f"true exited {result.exit_code}: {result.output[-300:]}")
        return {"start": t1 - t0, "first_exec": t2 - t1, "total": t2 - t0, "stop": t3 - t2}

    def rt_cold(self, k: int) -> dict:
        self.shared_down()
        out: dict[str, list[float]] = {}
        for _ in range(k):
            tmp = Path(tempfile.mkdtemp(prefix="cold-", dir=self.root))
            runtime = self.Runtime(tmp / "state", tmp / "cache", owner=OWNER)
            before = len(self.unpack)
            sample = self.start_exec_stop(runtime, "cold", self.fresh_image())
            if len(self.unpack) > before:
                sample["unpack"] = self.unpack[-1]
            for key, value in sample.items():
                out.setdefault(key, []).append(value)
            subprocess.run(["rm", "-rf", "--one-file-system", str(tmp)], check=True)
            os.sync()  # the unpacked root's writeback must not land in the next block
        return out

    def rt_warm(self, k: int, shared: bool = False) -> dict:
        (self.shared_upd if shared else self.shared_down)()
        out: dict[str, list[float]] = {}
        for _ in range(k):
            for key, value in self.start_exec_stop(self.runtime, "warm", self.image).items():
                out.setdefault(key, []).append(value)
        return out

    def rt_warm_shared(self, k: int) -> dict:
        return self.rt_warm(k, shared=True)

    def _acquire(self, image: Path) -> float:
        t = time.perf_counter()
        lease = self.fleet.acquire(image)
        took = time.perf_counter() - t
        lease.release()
        time.sleep(0.3)  # let the worker stop it before the next one (not timed)
        return took

    def fleet_cold(self, k: int) -> dict:
        self.shared_down()
        samples = [self._acquire(self.fresh_image()) for _ in range(k)]
        if self.impl == "old":  # unpacked roots of the cold images go (outside the timing)
            from sandfleet.runtime.local import image_key

            self.Runtime(self.root / "evict-state", self.root / "fleet-cache").evict(
                0, keep=image_key(self.image))
            os.sync()
        return {"acquire": samples}

    def fleet_warm(self, k: int) -> dict:
        self.shared_upd()
        return {"acquire": [self._acquire(self.image) for _ in range(k)]}

    def rt_exec(self, k: int) -> dict:
        self.shared_upd()
        return {"exec": timed(lambda: self.runtime.exec("shared", ["true"], timeout=30), k,
                              warmup=2)}

    def rt_exec_idle(self, k: int) -> dict:
        self.shared_upd()
        samples = []
        for _ in range(k):
            time.sleep(0.2)
            samples += timed(lambda: self.runtime.exec("shared", ["true"], timeout=30), 1,
                             warmup=0)
        return {"exec": samples}

    def lease_exec(self, k: int) -> dict:
        self.shared_upd()
        return {"exec": timed(lambda: self.lease.run("true"), k, warmup=5)}

    # -- where the new start's time goes

    def profile(self, k: int) -> dict:
        """``k`` cold starts + first exec with every step timestamped (see module doc):
        ``{"trials": [[[event, seconds since the start call], ...], ...]}``."""
        from sandfleet.runtime import local

        self.shared_down()
        events: list[tuple[str, float]] = []
        stage = ["start"]

        def ev(name: str) -> None:
            events.append((f"{stage[0]}: {name}", time.monotonic()))

        log_path = self.root / "helper-events.log"
        wrapper = self.root / "helper_timed.py"
        wrapper.write_text(TIMED_HELPER.format(log=str(log_path), helper=str(local.HELPER)))
        saved_helper, saved_popen = local.HELPER, subprocess.Popen

        class Popen(saved_popen):
            def __init__(self, *args, **kwargs):
                ev("spawn<")
                super().__init__(*args, **kwargs)
                ev("spawn>")

        def around(obj, name: str, before: str | None, after: str | None):
            fn = getattr(obj, name, None)
            if fn is None:  # not in this version
                return

            def timed_call(*args, **kwargs):
                if before:
                    ev(before)
                try:
                    return fn(*args, **kwargs)
                finally:
                    if after:
                        ev(after)
            setattr(obj, name, timed_call)

        trials = []
        local.HELPER, subprocess.Popen = wrapper, Popen
        try:
            for _ in range(k):
                tmp = Path(tempfile.mkdtemp(prefix="prof-", dir=self.root))
                runtime = self.Runtime(tmp / "state", tmp / "cache", owner=OWNER)
                around(runtime, "partition", None, "image partition read")
                around(runtime.uids, "acquire", None, "uid slot locked")
                around(runtime.cgroups, "create", "cgroups<", "cgroups>")
                around(runtime, "_read_info", None, "bwrap reports its pid")
                around(runtime, "_userns_ready", None, "uid/gid maps written")
                around(runtime, "_launch", None, "pid 1 runs")
                around(runtime, "_read_env", None, "image env read")
                probe = getattr(runtime, "_image_env", None)  # an exec, in early versions

                def env_probe(sandbox_id, probe=probe):
                    stage[0] = "env probe"
                    ev("call")
                    try:
                        return probe(sandbox_id)
                    finally:
                        ev("returned")
                        stage[0] = "start"
                if probe is not None:
                    runtime._image_env = env_probe
                log_path.write_text("")
                events.clear()
                image = self.fresh_image()
                stage[0] = "start"
                ev("call")
                runtime.start("prof", self.Spec(image=image))
                ev("returned")
                stage[0] = "exec"
                ev("call")
                runtime.exec("prof", ["true"], timeout=30)
                ev("returned")
                runtime.stop("prof")
                shutil.rmtree(tmp, ignore_errors=True)
                trials.append(merge_events(events, log_path.read_text()))
        finally:
            local.HELPER, subprocess.Popen = saved_helper, saved_popen
        return {"trials": trials}

    def micro(self, k: int) -> dict:
        """Parts of a start on their own: Python start-up and the helper's imports, mkfs of
        the default quota, a template disk copied instead, loop mounts."""
        from sandfleet.runtime import local

        py = [sys.executable, "-I", "-S"]
        helper = str(local.HELPER)
        load = (f"import marshal; exec(marshal.loads(open({helper!r}, 'rb').read()[16:]), {{}})"
                if helper.endswith(".pyc") else
                f"exec(compile(open({helper!r}).read(), {helper!r}, 'exec'), {{}})")
        storage_mb = self.Spec(image=self.image).storage_mb
        tmp = Path(tempfile.mkdtemp(prefix="micro-", dir=self.root))
        disk, template, mnt = tmp / "disk.img", tmp / "template.img", tmp / "mnt"
        mnt.mkdir()
        mkfs = ["mkfs.ext4", "-q", "-F", "-m", "0", "-i", "32768", "-O", "^has_journal",
                "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard"]

        def sparse(path: Path) -> None:
            with open(path, "wb") as f:
                f.truncate(storage_mb << 20)

        def run(argv: list[str]) -> None:
            subprocess.run(argv, check=True, stdin=subprocess.DEVNULL, capture_output=True)

        sparse(template)
        run([*mkfs, str(template)])
        from sandfleet.runtime import sif

        part = sif.read_partition(self.image)
        private = ["unshare", "-m", "--propagation", "private", "sh", "-c"]  # off the host
        squash = (f"mount -t squashfs -o ro,loop,offset={part.offset},sizelimit={part.size} "
                  f"{self.image} {mnt} && umount -d {mnt}")
        ext4 = f"mount -t ext4 -o loop {template} {mnt} && umount -d {mnt}"
        ways = {
            "python -I -S -c pass": lambda: run([*py, "-c", "pass"]),
            "python -I -S -c 'import ctypes'": lambda: run([*py, "-c", "import ctypes"]),
            "python -I -S: load helper.py (compile + imports)": lambda: run([*py, "-c", load]),
            "nsenter --version (a C tool's start)": lambda: run(["nsenter", "--version"]),
            f"truncate + mkfs.ext4 ({storage_mb} MiB, the seal's flags)":
                lambda: (sparse(disk), run([*mkfs, str(disk)])),
            f"cp --sparse=always of a pre-made {storage_mb} MiB ext4":
                lambda: run(["cp", "--sparse=always", str(template), str(disk)]),
            "unshare -m sh -c true (baseline of the two below)":
                lambda: run([*private, "true"]),
            "mount + umount -d ext4 -o loop (fresh loop device)": lambda: run([*private, ext4]),
            "mount + umount -d squashfs -o loop (the SIF)": lambda: run([*private, squash]),
        }
        try:
            return {name: timed(fn, k, warmup=1) for name, fn in ways.items()}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def merge_events(mine: list[tuple[str, float]], helper_log: str) -> list[tuple[str, float]]:
    """The agent's events (named "stage: what") and the helper's (``pid what time`` lines,
    each put in the stage it falls in), in time order, as seconds since the first."""
    stages = sorted(mine, key=lambda e: e[1])
    merged = list(stages)
    for line in helper_log.splitlines():
        name, t = line.split(" ", 1)[1].rsplit(" ", 1)
        stage = next((s for s, ts in reversed(stages) if ts <= float(t)), "start: ")
        merged.append((f"{stage.split(': ')[0]}: {name}", float(t)))
    merged.sort(key=lambda e: e[1])
    t0 = merged[0][1]
    return [(name, round(t - t0, 6)) for name, t in merged]


def agent_main(impl: str, root: Path, image: Path) -> None:
    """Answer one JSON request per line on stdin (``{"op": ..., "k": ...}``) on the fd that
    was stdout; stdout itself goes to stderr (the CLI's output must not mix in)."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    logging.basicConfig(level=logging.WARNING, format=f"[{impl}] %(levelname)s %(message)s")
    agent = None
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if agent is None:
                agent = Agent(impl, root, image)
            fn = getattr(agent, req["op"])
            result = {"ok": True, "result": fn(req["k"]) if "k" in req else fn()}
        except Exception as e:  # noqa: BLE001 - sent to the parent, which decides
            result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                      "trace": traceback.format_exc()[-3000:]}
        reply.write(json.dumps(result) + "\n")
        if req["op"] == "close":
            break


# ---- the parent: schedule, collect, print


class AgentProc:
    def __init__(self, impl: str, tree: Path, root: Path, image: Path,
                 helper: Path | None = None):
        self.impl = impl
        root.mkdir(parents=True)
        env = {**os.environ, "PYTHONPATH": str(tree), "USER": OWNER, "LOGNAME": OWNER}
        if helper is not None:
            env["SEAL_BENCH_HELPER"] = str(helper.resolve())
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "agent", impl, str(root),
             str(image)], cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, bufsize=1)

    def call(self, op: str, k: int | None = None) -> dict:
        self.proc.stdin.write(json.dumps({"op": op} | ({} if k is None else {"k": k})) + "\n")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.impl} agent died (exit {self.proc.wait()})")
        answer = json.loads(line)
        if not answer["ok"]:
            raise RuntimeError(f"{self.impl} agent, {op}: {answer['error']}\n{answer['trace']}")
        return answer["result"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                problems = self.call("close")["problems"]
                if problems:
                    log.warning("%s agent cleanup: %s", self.impl, problems)
                self.proc.wait(timeout=60)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                log.warning("%s agent: %s; killing it (pid %d)", self.impl, e, self.proc.pid)
                self.proc.kill()
                self.proc.wait()


def checkout(path: Path | None, rev: str, label: str, stack: contextlib.ExitStack) -> Path:
    """An implementation's tree: ``path`` as given, or a worktree of ``rev`` made now and
    removed at the end."""
    if path is not None:
        return path.resolve()
    tree = Path(tempfile.mkdtemp(prefix=f"seal-bench-{label}-"))
    tree.rmdir()
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), rev],
                   check=True)
    stack.callback(subprocess.run, ["git", "-C", str(REPO), "worktree", "remove", "--force",
                                    str(tree)], check=False)
    return tree


def describe(tree: Path) -> str:
    """The tree's commit, and whether its sandfleet/ differs from it."""
    rev = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, check=False).stdout.strip() or "?"
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--", "sandfleet"],
                           capture_output=True, text=True, check=False).stdout.strip()
    return f"{rev}{' + uncommitted sandfleet/ changes' if dirty else ''}"


def phases(trials: list[list[tuple[str, float]]]) -> list[dict]:
    """Consecutive events as named steps, median and spread over the trials (a step
    is kept when every trial has it, in the first trial's order)."""
    steps: dict[str, list[float]] = {}
    order: list[str] = []
    for events in trials:
        seen: dict[str, int] = {}
        for (a, ta), (b, tb) in itertools.pairwise(events):
            stage_a, _, what_a = a.partition(": ")
            stage_b, _, what_b = b.partition(": ")
            name = f"{stage_a}: {what_a} -> {what_b if stage_a == stage_b else b}"
            seen[name] = seen.get(name, 0) + 1
            name += f" (#{seen[name]})" if seen[name] > 1 else ""
            if name not in steps:
                order.append(name)
            steps.setdefault(name, []).append(tb - ta)
    return [{"step": name, "median_ms": round(statistics.median(steps[name]) * 1e3, 2),
             "min_ms": round(min(steps[name]) * 1e3, 2),
             "max_ms": round(max(steps[name]) * 1e3, 2)}
            for name in order if len(steps[name]) == len(trials)]


GROUPS = (
    ("Python start-up (spawn to the helper's first line)", ("spawn> -> python up",)),
    ("helper.py compile + imports (ctypes, json...)",
     ("python up -> helper loaded",)),
    ("cgroup v1 joins (writes to cgroup.procs)",
     ("private_mount_namespace> -> mount -t squashfs<", "enter< -> no_nested_userns<")),
    ("mount squashfs -o loop (the SIF)", ("mount -t squashfs< -> mount -t squashfs>",)),
    ("idmapped image (user ns for the map + open_tree/mount_setattr)",
     ("mapping_userns< -> mapping_userns>", "idmapped_bind< -> idmapped_bind>")),
    ("truncate + mkfs.ext4 (the quota disk)",
     ("make_disk< -> mkfs.ext4<", "mkfs.ext4< -> mkfs.ext4>")),
    ("mount ext4 -o loop", ("mount -t ext4< -> mount -t ext4>",)),
    ("mount overlay", ("mount -t overlay< -> mount -t overlay>",)),
    ("bwrap: exec to pid 1 running (+ pid 1 reporting the image env, where it does)",
     ("mount -t overlay> -> exec bwrap", "exec bwrap -> bwrap reports its pid",
      "bwrap reports its pid -> uid/gid maps written", "uid/gid maps written -> pid 1 runs",
      "uid/gid maps written -> image env read", "image env read -> pid 1 runs")),
    ("setns, chroot, caps dropped, fork + exec",
     ("no_nested_userns< -> no_nested_userns>", "no_nested_userns> -> drop_capabilities<",
      "drop_capabilities< -> drop_capabilities>", "drop_capabilities> -> exec bash",
      "drop_capabilities> -> exec true")),
    ("the command inside (the env probe's bash where it is an exec; true)",
     ("exec bash -> enter>", "exec true -> enter>")),
    ("helper exit + the runtime collecting it", ("enter> -> returned",)),
)
"""Steps of ``phases`` (stage prefix left out) summed into what they are."""
STAGES = ("start", "env probe", "exec")


def grouped(steps: list[dict]) -> list[dict]:
    """``phases`` summed per group and stage (sums of medians); "rest": what no group has
    (the runtime's own work between the steps)."""
    rows = {label: dict.fromkeys(STAGES, 0.0) for label, _ in GROUPS}
    rows["rest (runtime's own steps, spawning)"] = dict.fromkeys(STAGES, 0.0)
    for step in steps:
        stage, _, what = step["step"].partition(": ")
        if stage not in STAGES:
            continue
        label = next((label for label, names in GROUPS if what in names),
                     "rest (runtime's own steps, spawning)")
        rows[label][stage] += step["median_ms"]
    return [{"what": label, **{k: round(v, 1) for k, v in row.items()},
             "all": round(sum(row.values()), 1)} for label, row in rows.items()]


def table(report: dict) -> str:
    rows = ["| what | old p50 | old p99 | new p50 | new p99 | new/old p50 | new/old p99 | n |",
            "|---|---|---|---|---|---|---|---|"]
    for row in report["compare"]:
        rows.append(f"| {row['what']} | {row['old']['p50_ms']} | {row['old']['p99_ms']} | "
                    f"{row['new']['p50_ms']} | {row['new']['p99_ms']} | "
                    f"{row['ratio_p50']} | {row['ratio_p99']} | {row['old']['n']}/"
                    f"{row['new']['n']} |")
    rows.append("")
    rows.append("ms; p99 of a handful of samples is their maximum. "
                + "; ".join(report["notes"]))
    if report.get("profile"):
        rows += ["", "| new cold start + first exec, step | median ms | min | max |",
                 "|---|---|---|---|"]
        rows += [f"| {p['step']} | {p['median_ms']} | {p['min_ms']} | {p['max_ms']} |"
                 for p in report["profile"]]
    if report.get("profile_groups"):
        groups = report["profile_groups"]
        cols = [k for k in (*STAGES, "all") if any(g[k] for g in groups)]
        heads = {"start": "start", "env probe": "env probe exec (in start)",
                 "exec": "first exec(true)", "all": "all"}
        rows += ["", "| new cold start, grouped (sums of medians, ms) | "
                 + " | ".join(heads[k] for k in cols) + " |", "|---" * (len(cols) + 1) + "|"]
        rows += [f"| {g['what']} | " + " | ".join(str(g[k]) for k in cols) + " |"
                 for g in groups if g["all"]]
        rows.append("| total | " + " | ".join(
            str(round(sum(g[k] for g in groups), 1)) for k in cols) + " |")
    if report.get("micro"):
        rows += ["", "| on its own (new agent's python, this machine) | p50 ms | p99 ms |",
                 "|---|---|---|"]
        rows += [f"| {m['what']} | {m['p50_ms']} | {m['p99_ms']} |" for m in report["micro"]]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", type=Path, help="a SIF (default: the test store's base)")
    parser.add_argument("--old-rev", default="2dfe18e", help="the implementation before")
    parser.add_argument("--old-tree", type=Path, help="a checkout of it (default: a "
                        "worktree of --old-rev, made and removed here)")
    parser.add_argument("--new-rev", default="HEAD", help="the sealed implementation")
    parser.add_argument("--new-tree", type=Path, help="a checkout of it ('.': this working "
                        "tree as it is, uncommitted changes included)")
    parser.add_argument("--helper", type=Path, help="run the new runtime-level sandboxes "
                        "through this helper.py (or .pyc) instead of its own, to measure a "
                        "proposed change (the fleet's worker keeps its own)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    parser.add_argument("--cold", type=int, default=2, help="runtime cold starts per round")
    parser.add_argument("--warm", type=int, default=5, help="runtime warm starts per round "
                        "(each way)")
    parser.add_argument("--fleet-cold", type=int, default=2, help="cold acquires per round")
    parser.add_argument("--fleet-warm", type=int, default=5, help="warm acquires per round")
    parser.add_argument("--rt-exec", type=int, default=15, help="runtime.exec per round")
    parser.add_argument("--rt-exec-idle", type=int, default=4,
                        help="runtime.exec after 0.2 s idle, per round")
    parser.add_argument("--exec", type=int, default=150, help="lease.run per round")
    parser.add_argument("--profile", type=int, default=5, help="instrumented new cold starts")
    parser.add_argument("--micro", type=int, default=5, help="samples of each micro-timing")
    parser.add_argument("--max-s", type=float, default=300, help="no new round past this")
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if os.geteuid() != 0:
        sys.exit("seal_bench: both local runtimes need root")
    image = args.image or next(iter(sorted((STORE / "bases").glob("*.sif"))), None)
    if image is None:
        sys.exit(f"no --image and no base in {STORE}/bases (run the tests once: base_store)")
    image = image.resolve()
    started, t_start = time.strftime("%Y-%m-%d %H:%M:%S"), time.monotonic()
    counts = {"rt_cold": args.cold, "rt_warm": args.warm, "rt_warm_shared": args.warm,
              "fleet_cold": args.fleet_cold, "fleet_warm": args.fleet_warm,
              "rt_exec": args.rt_exec, "rt_exec_idle": args.rt_exec_idle,
              "lease_exec": args.exec}
    samples: dict[str, dict[str, dict[str, list[float]]]] = {"old": {}, "new": {}}
    report: dict = {"benchmark": "seal_bench", "machine": machine(), "image": str(image),
                    "old_rev": args.old_rev, "started": started, "notes": [], "args": {
                        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    with contextlib.ExitStack() as stack:
        root = Path(tempfile.mkdtemp(prefix="seal-bench-"))
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        trees = {impl: checkout(getattr(args, f"{impl}_tree"), getattr(args, f"{impl}_rev"),
                                impl, stack) for impl in ("old", "new")}
        report["revs"] = {impl: describe(tree) for impl, tree in trees.items()}
        if args.helper:
            report["revs"]["new"] += f", helper {args.helper}"
        agents = {}
        for impl, tree in trees.items():
            agents[impl] = AgentProc(impl, tree, root / impl, image,
                                     args.helper if impl == "new" else None)
            stack.callback(agents[impl].close)
        for impl, agent in agents.items():
            log.info("%s: bringing up its fleet", impl)
            agent.call("fleet_start")
        rounds_done = 0
        for r in range(args.rounds):
            if time.monotonic() - t_start > args.max_s:
                log.warning("--max-s reached: %d rounds of %d", r, args.rounds)
                break
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for op in OPS:
                if counts[op] <= 0:
                    continue
                for impl in order:
                    for series, values in agents[impl].call(op, counts[op]).items():
                        samples[impl].setdefault(op, {}).setdefault(series, []).extend(values)
            rounds_done += 1
            log.info("round %d/%d done (%.0f s)", r + 1, args.rounds,
                     time.monotonic() - t_start)
        report["rounds_done"] = rounds_done
        if args.profile > 0:
            log.info("profiling %d new cold starts", args.profile)
            trials = agents["new"].call("profile", args.profile)["trials"]
            report["profile"], report["profile_trials"] = phases(trials), trials
            report["profile_groups"] = grouped(report["profile"])
            at = [dict(trial) for trial in trials]
            report["notes"].append(
                "instrumented (profile) start + first exec: median "
                f"{statistics.median(t['exec: returned'] for t in at) * 1e3:.0f} ms, start "
                f"{statistics.median(t['start: returned'] for t in at) * 1e3:.0f} ms "
                "(the timestamps cost a little; compare rt_cold above)")
        if args.micro > 0:
            micro = agents["new"].call("micro", args.micro)
            report["micro"] = [summary(what, values) for what, values in micro.items()]
    report["load_end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    report["wall_s"] = round(time.monotonic() - t_start, 1)
    report["samples"] = samples
    compare = []
    for op in OPS:
        for series in samples["old"].get(op, {}):
            if series not in samples["new"].get(op, {}):
                continue
            old = summary(f"{op}.{series}", samples["old"][op][series])
            new = summary(f"{op}.{series}", samples["new"][op][series])
            compare.append({"what": f"{op}.{series}" + (f": {WHAT[op]}" if series in (
                "total", "acquire", "exec") else ""), "old": old, "new": new,
                "ratio_p50": round(new["p50_ms"] / old["p50_ms"], 2),
                "ratio_p99": round(new["p99_ms"] / old["p99_ms"], 2)})
    report["compare"] = compare
    unpack = samples["old"].get("rt_cold", {}).get("unpack")
    report["notes"] += [f"load avg at the end {report['load_end']}",
                        f"{report['rounds_done']} rounds in {report['wall_s']} s"]
    if unpack:
        report["notes"].append(f"old cold: unsquashfs {statistics.median(unpack) * 1e3:.0f} ms "
                               "of it (median)")
    emit(report, f"seal_bench: new ({report['revs']['new']}) vs old ({report['revs']['old']}); "
         f"{report['machine']}; {started}", table(report), args.out)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "agent":
        agent_main(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
    else:
        main()
