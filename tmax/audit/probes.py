"""The deterministic probes: real sandboxes of a task's image on the fleet, no LLM.

Per task, each in a fresh sandbox of the task's image:

- **nop**: the untouched environment must score below 1 (it is also where the image is
  listed and the files the task's build added are read, against a listing of its base);
- **oracle**: the reference solution must score 1; the files it wrote are its *outputs*;
- **leak scan** (no sandbox): added files whose content equals or contains an answer (an
  oracle output, a tests/ data file) or equals any tests/ file;
- **copy**: each leak candidate copied to the output locations it matched, as is and with a
  line appended, then verified: full reward proves ``answer_leak``;
- **replay**: the oracle's outputs written into a fresh sandbox, nothing run; then only its
  data outputs, without the programs it wrote: full reward when the instruction asked for a
  program proves the verifier never runs it (``verifier_too_weak``);
- **mutation**: the replay with one output the verifier reads emptied or altered: full
  reward proves it does not check that output's content (``verifier_too_weak``);
- **paths**: outputs the verifier reads that the instruction never names, or names in
  another folder (``instruction_verifier_mismatch``).
- **exploits**: scripted reward hacks from the untouched environment (``tmax.audit.exploits``:
  uv's env file, ``python -m`` shadows, PATH programs, a lingering reward writer, and
  ``os._exit(0)`` in the modules the tests could import): full reward proves
  ``verifier_too_weak``, the hack its evidence.

What a probe proves is a ``Finding``; the first of ``PROBE_LABELS`` with a finding is the
task's label. A task no probe faults stays unlabelled. Infrastructure failures are retried
and, when they persist, leave the task unaudited (a rerun picks it up), never labelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import shlex
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sandfleet import ImageMissing, InfraError
from tmax.audit.exploits import run_exploits
from tmax.audit.labels import PROBE_LABELS, Label
from tmax.audit.settings import ProbeSettings
from tmax.audit.static import (
    PROBE_DIR,
    Stat,
    added,
    changed,
    instruction_names_other,
    is_program,
    leak_matches,
    listing_command,
    mentions,
    mutation_candidates,
    mutations,
    named_paths,
    parse_listing,
    verifier_text,
)
from tmax.rollout.run import DEFAULT_PATH, Grade, LeaseShell, TaskImages, grade, plan_errors
from tmax.tasks.environment import PROBE as ENV_PROBE
from tmax.tasks.environment import parse_probe
from tmax.tasks.model import Task

log = logging.getLogger(__name__)

SYSTEM = ("/usr/lib/", "/usr/bin/", "/usr/sbin/", "/usr/include/", "/usr/libexec/",
          "/lib/", "/lib64/", "/lib32/", "/bin/", "/sbin/", "/etc/", "/usr/share/")
"""Left out of the leak scan when the base cannot be listed (a task's own files are
rarely there; /usr/share/doc is kept)."""
INFRA_RETRIES = 2



WRITE_COMMAND_BYTES = 256 << 10
"""The longest command ``Box.write`` sends at once (the wire takes up to 1 MiB)."""


def command_chunks(lines: list[str], limit: int) -> list[str]:
    """``lines`` joined with `` && `` into commands of at most ``limit`` characters each
    (one longer line is a command of its own), in order."""
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for line in lines:
        if current and size + 4 + len(line) > limit:
            chunks.append(" && ".join(current))
            current, size = [], 0
        size += (4 if current else 0) + len(line)
        current.append(line)
    if current:
        chunks.append(" && ".join(current))
    return chunks

class ProbeError(Exception):
    """A probe's own command failed in the sandbox (not the task's doing)."""

    def __init__(self, what: str, output: str):
        super().__init__(f"{what}: {output[-500:]}")
        self.what, self.output = what, output


@dataclass
class Finding:
    """What one probe proved about a task."""

    label: Label
    probe: str
    evidence: str


@dataclass
class ProbeReport:
    """Everything the probes saw of one task; ``label`` is what they prove."""

    task: str
    findings: list[Finding] = field(default_factory=list)
    probes: dict[str, Any] = field(default_factory=dict)
    sandbox_s: float = 0.0
    sandboxes: int = 0
    wall_s: float = 0.0
    error: str = ""
    """Set when the task could not be audited (no image, infrastructure): no label."""

    @property
    def label(self) -> Label | None:
        found = {f.label for f in self.findings}
        return next((label for label in PROBE_LABELS if label in found), None)

    def add(self, label: Label, probe: str, evidence: str) -> None:
        self.findings.append(Finding(label, probe, evidence))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["label"] = self.label
        return data


@dataclass(frozen=True)
class Output:
    """A file the oracle wrote, as it left it."""

    path: str
    data: bytes
    mode: int
    program: bool


class Box:
    """One probe sandbox: a fleet lease with list, fetch, write, solve and verify."""

    def __init__(self, shell: LeaseShell, task: Task | None, workdir: str, base_path: str,
                 settings: ProbeSettings, scratch: Path,
                 image_env: dict[str, str] | None = None):
        self.shell, self.task, self.workdir, self.base_path = shell, task, workdir, base_path
        self.settings, self.scratch = settings, scratch
        self.image_env = image_env or {}
        """The image's environment as built (the verifier's)."""
        self.dir = PROBE_DIR + secrets.token_hex(8)  # unguessable, made fresh: no planted links
        self._made = False

    async def folder(self) -> str:
        """The probe's own folder in the sandbox, made on first use (mkdir fails on
        anything already there)."""
        if not self._made:
            await self.run(f"mkdir -m 700 {self.dir}", "making the probe's folder")
            self._made = True
        return self.dir

    async def run(self, command: str, what: str, timeout: float | None = None) -> str:
        result = await self.shell.run(command, timeout or self.settings.exec_timeout_s)
        if result.exit_code != 0 or result.timed_out:
            raise ProbeError(what, result.output)
        return result.output

    def _local(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.scratch)) / name

    async def listing(self) -> dict[str, Stat]:
        folder = await self.folder()
        await self.run(listing_command(folder), "listing the image's files")
        got = await self.shell.get_file(f"{folder}/files", self._local("files"))
        return await asyncio.to_thread(lambda: parse_listing(got.read_bytes()))

    async def fetch(self, paths: list[str]) -> dict[str, bytes]:
        """The contents of ``paths`` (one tar of them made in the sandbox; files that
        vanished meanwhile are left out)."""
        if not paths:
            return {}
        folder = await self.folder()
        want = self._local("want")
        want.write_bytes(b"".join(p.lstrip("/").encode("utf-8", "surrogateescape") + b"\0"
                                  for p in paths))
        await self.shell.put_file(want, f"{folder}/want")
        await self.run(f"tar -C / --null --ignore-failed-read -T {folder}/want "
                       f"-cf {folder}/files.tar", "packing files to read")
        tar_path = await self.shell.get_file(f"{folder}/files.tar", self._local("tar"))
        files = await asyncio.to_thread(read_tar, tar_path, self.settings.max_file_bytes)
        await self.run(f"rm -f {folder}/files.tar {folder}/want", "cleaning up")
        return files

    async def write(self, files: dict[str, tuple[bytes, int]]) -> None:
        """Write each path's content with its mode (folders made as needed)."""
        if not files:
            return
        stage = self._local("stage")
        stage.mkdir()
        lines = []
        for i, (path, (data, mode)) in enumerate(sorted(files.items())):
            (stage / str(i)).write_bytes(data)
            q = shlex.quote(path)
            lines.append(f"mkdir -p \"$(dirname {q})\" && cat {self.dir}/stage/{i} > {q} && "
                         f"chmod {mode & 0o7777:o} {q}")
        folder = await self.folder()
        await self.shell.put_file(stage, f"{folder}/stage")
        for chunk in command_chunks(lines, WRITE_COMMAND_BYTES):  # (a solution's whole
            await self.run(chunk, "writing files")                # site-packages: many)
        await self.run(f"rm -rf {folder}/stage", "writing files")

    @property
    def _task(self) -> Task:
        assert self.task is not None, "a base's sandbox has no task"
        return self.task

    async def solve(self) -> None:
        await self.shell.put_file(self._task.solution_dir, "/solution")
        result = await self.shell.run(
            f"cd {shlex.quote(self.workdir)} && bash /solution/solve.sh",
            self._task.config.agent.timeout_sec)
        self.solve_output = result.output[-2000:]
        await self.shell.run(f"cd {shlex.quote(self.workdir)}", 30)

    async def verify(self) -> Grade:
        await self.shell.run(f"rm -rf {self.dir}; cd {shlex.quote(self.workdir)}", 30)
        return await grade(self._task, self.shell, self.workdir, self.base_path,
                           image_env=self.image_env)


def read_tar(path: Path, max_file_bytes: int) -> dict[str, bytes]:
    """The regular files of an uncompressed tar (``/``-rooted names), each at most
    ``max_file_bytes``: read, never extracted, so names and links cannot reach the host."""
    files: dict[str, bytes] = {}
    with tarfile.open(path, mode="r:") as tar:
        for member in tar:
            if member.isfile() and member.size <= max_file_bytes and \
                    (f := tar.extractfile(member)) is not None:
                files["/" + member.name] = f.read()
    return files


class Prober:
    """Runs the probes of tasks on a fleet (an ``AsyncFleetClient``) with their images."""

    def __init__(self, fleet: Any, images: TaskImages, settings: ProbeSettings | None = None):
        self.fleet, self.images = fleet, images
        self.settings = settings or ProbeSettings()
        self._base_listings: dict[str, asyncio.Task] = {}

    async def run(self, task: Task) -> ProbeReport:
        """The probes of ``task``; never raises for the task's or the fleet's failures."""
        t0 = time.monotonic()
        report = ProbeReport(task.task_id)
        for attempt in range(INFRA_RETRIES + 1):
            report = ProbeReport(task.task_id)
            try:
                with tempfile.TemporaryDirectory(prefix="tmax-audit-") as scratch:
                    await _Probes(self, task, report, Path(scratch)).run()
                break
            except ImageMissing as e:
                report.error = f"no usable image: {e}"
                break
            except InfraError as e:
                report.error = f"infrastructure: {e}"
                log.info("%s: probes hit an infra failure (attempt %d): %s", task.task_id,
                         attempt + 1, e)
            except ProbeError as e:
                report.error = f"probe: {e}"
                break
            except Exception as e:  # a task that breaks a probe must not stop the others
                log.exception("%s: the probes crashed", task.task_id)
                report.error = f"probe crashed: {type(e).__name__}: {e}"
                break
        report.wall_s = round(time.monotonic() - t0, 3)
        report.sandbox_s = round(report.sandbox_s, 3)
        if report.error:
            report.findings.clear()
        return report

    async def base_listing(self, task: Task, scratch: Path) -> dict[str, Stat] | None:
        """The listing of the base the task's image was built over (once per base), or
        None when there is none to list."""
        errors: tuple[type[Exception], ...] = (*plan_errors(), OSError)
        try:
            base = self.images.builds.plan(task).base
            entry = self.images.builds.store.read().bases.get(base)
        except errors as e:  # the image was resolved, so rare
            log.info("%s: no base to list (%s)", task.task_id, e)
            return None
        if entry is None:
            return None
        sif = str(self.images.builds.store.path(entry.sif))
        if sif not in self._base_listings:
            self._base_listings[sif] = asyncio.ensure_future(self._list_base(sif, scratch))
        try:
            return await asyncio.shield(self._base_listings[sif])
        except Exception as e:  # noqa: BLE001 -- any failure: scan without the base
            self._base_listings.pop(sif, None)
            log.info("base %s: not listed (%s); scanning outside system folders", base, e)
            return None

    async def _list_base(self, sif: str, scratch: Path) -> dict[str, Stat]:
        async with self.fleet.lease(sif, cpus=1, memory_mb=512, workdir="/") as lease:
            shell = LeaseShell(lease)
            box = Box(shell, None, "/", DEFAULT_PATH, self.settings, scratch)
            return await box.listing()


class _Probes:
    """The probes of one task, in order; fills ``report``."""

    def __init__(self, prober: Prober, task: Task, report: ProbeReport, scratch: Path):
        self.prober, self.task, self.report, self.scratch = prober, task, report, scratch
        self.settings = prober.settings
        self.sif, self.workdir = "", ""

    @contextlib.asynccontextmanager
    async def sandbox(self) -> AsyncIterator[Box]:
        env = self.task.config.environment
        # the agent's network, as the build-time checks and rollouts give it (a Harbor task
        # that says nothing: the package registries, which its solution may install from)
        network, hosts = self.task.config.agent_network("registries")
        t0 = time.monotonic()
        self.report.sandboxes += 1
        try:
            async with self.prober.fleet.lease(self.sif, cpus=env.cpus,
                                               memory_mb=env.memory_mb,
                                               storage_mb=env.storage_mb,
                                               network=network, allowed_hosts=hosts,
                                               workdir=self.workdir,
                                               user=self.prober.images.user(self.task)
                                               ) as lease:
                shell = LeaseShell(lease, self.prober.images.verifier_user(self.task))
                image_env = parse_probe((await shell.run(ENV_PROBE, 30)).output)
                if start := self.prober.images.start_command(self.task):  # its ENTRYPOINT
                    await shell.run(start, 60)
                yield Box(shell, self.task, self.workdir,
                          image_env.get("PATH") or DEFAULT_PATH, self.settings, self.scratch,
                          image_env)
        finally:
            self.report.sandbox_s += time.monotonic() - t0

    async def run(self) -> None:
        task, report, probes = self.task, self.report, self.report.probes
        self.sif, self.workdir = await asyncio.to_thread(self.prober.images.resolve, task)
        base = await self.prober.base_listing(task, self.scratch)

        async with self.sandbox() as box:  # nop; the image's files
            initial = await box.listing()
            new, unscanned = scan_list(initial, base, self.settings)
            image_files = await box.fetch(new)
            nop = await box.verify()
        probes["nop"] = _grade_dict(nop)
        probes["image"] = {"files": len(initial), "added": len(new) + unscanned,
                           "scanned": len(new), "base_listed": base is not None}
        if nop.reward is None:
            report.add("environment_broken", "nop",
                       f"the verifier cannot grade the untouched environment: {nop.error}")
            return
        if nop.reward >= 1.0:
            report.add("verifier_too_weak", "nop",
                       f"the untouched environment scores {nop.reward:g}: the verifier "
                       "passes without any work")

        outputs: list[Output] = []
        if not task.has_solution:
            probes["oracle"] = {"reward": None, "note": "no reference solution"}
        else:
            async with self.sandbox() as box:
                await box.solve()
                after = await box.listing()
                paths = [p for p in changed(initial, after)
                         if after[p].size <= self.settings.max_file_bytes and _utf8(p)]
                got = await box.fetch(paths)
                oracle = await box.verify()
            outputs = [Output(p, got[p], after[p].mode, is_program(p, got[p], after[p].mode))
                       for p in paths if p in got]
            probes["oracle"] = _grade_dict(oracle) | {"solve_output": box.solve_output}
            probes["outputs"] = [{"path": o.path, "bytes": len(o.data), "mode": f"{o.mode:o}",
                                  "program": o.program} for o in outputs]
            if oracle.reward is None or oracle.reward < 1.0:
                why = oracle.error or f"it scores {oracle.reward:g}"
                report.add("solution_broken", "oracle",
                           f"the reference solution does not get full reward: {why} "
                           "(or the verifier is too strict)")
                outputs_ok = False
            else:
                outputs_ok = True
        if task.has_solution and outputs_ok:
            await self.copy_probes(image_files, outputs)
            await self.replay_probes(outputs)
            self.path_probe(outputs)
        else:
            await self.copy_probes(image_files, [])
        if self.settings.exploits and nop.reward < 1.0:
            await run_exploits(self.sandbox, report, self.workdir, image_files, outputs)
        self.explain_copies()

    def explain_copies(self) -> None:
        """A verifier that passes the untouched environment or an emptied or altered output
        passes a copied file for the same reason: the copy proves no leak there (the
        weak verifier is the finding; a repaired one is probed again)."""
        report = self.report
        if any(f.label == "verifier_too_weak" and f.probe in ("nop", "mutation")
               for f in report.findings):
            copies = [f for f in report.findings if f.probe == "copy"]
            if copies:
                report.findings = [f for f in report.findings if f.probe != "copy"]
                report.probes["copy_explained"] = (
                    "the verifier does not check the output's content, so the copies that "
                    "pass prove no leak: " + "; ".join(f.evidence for f in copies))

    # ---------------------------------------------------------------- leaks


    def targets(self, outputs: list[Output]) -> tuple[dict[str, bytes], dict[str, bytes]]:
        """(answers searched for inside image files, files whose exact copy is a leak)."""
        answers = {f"oracle:{o.path}": o.data for o in outputs if not o.program}
        exact: dict[str, bytes] = {}
        for path in sorted(self.task.tests_dir.rglob("*")):
            if path.is_file() and path.stat().st_size <= self.settings.max_file_bytes:
                rel = f"tests:{path.relative_to(self.task.tests_dir)}"
                data = path.read_bytes()
                exact[rel] = data
                if not is_program(path.name, data, path.stat().st_mode):
                    answers[rel] = data
        return answers, exact

    async def copy_probes(self, image_files: dict[str, bytes], outputs: list[Output]) -> None:
        answers, exact = self.targets(outputs)
        out_paths = {o.path for o in outputs}
        candidates = []
        for path, data in image_files.items():
            if path in out_paths:
                continue
            hits = leak_matches(data, answers, self.settings.min_leak_chars)
            hits += [name for name, want in exact.items() if want == data and name not in hits]
            if hits:
                # answers for an oracle output first, then the longest answer matched
                rank = (not any(h.startswith("oracle:") for h in hits),
                        -max(len(answers.get(h, exact.get(h, b""))) for h in hits))
                candidates.append((rank, path, data, hits))
        candidates.sort(key=lambda c: (c[0], c[1]))
        self.report.probes["leak_scan"] = {
            "candidates": [{"path": p, "matches": h, "sha256": hashlib.sha256(d).hexdigest()}
                           for _, p, d, h in candidates]}
        data_outputs = [o for o in outputs if not o.program]
        runs = []
        for _, path, data, hits in candidates[:self.settings.max_candidates]:
            to = [o for o in data_outputs if f"oracle:{o.path}" in hits] or data_outputs
            to = to[:self.settings.max_outputs]
            if not to:
                continue
            for variant, content in (("as is", data), ("appended", data + b"\ntmax probe\n")):
                async with self.sandbox() as box:
                    await box.write({o.path: (content, o.mode) for o in to})
                    g = await box.verify()
                runs.append({"file": path, "to": [o.path for o in to], "variant": variant,
                             "reward": g.reward, "error": g.error})
                if g.reward is not None and g.reward >= 1.0:
                    self.report.add("answer_leak", "copy",
                                    f"{path} is in the image; copied {variant} to "
                                    f"{', '.join(o.path for o in to)} it scores {g.reward:g}")
                    break
        self.report.probes["copy"] = runs

    # ---------------------------------------------------------------- replay

    async def replay(self, outputs: list[Output], swap: dict[str, bytes] | None = None
                     ) -> Grade:
        swap = swap or {}
        async with self.sandbox() as box:
            await box.write({o.path: (swap.get(o.path, o.data), o.mode) for o in outputs})
            return await box.verify()

    async def replay_probes(self, outputs: list[Output]) -> None:
        probes = self.report.probes
        if not outputs:
            probes["replay"] = {"note": "the oracle wrote no files"}
            return
        full = await self.replay(outputs)
        probes["replay"] = {"all": _grade_dict(full)}
        if full.reward is None or full.reward < 1.0:
            probes["replay"]["note"] = ("the oracle's files alone do not pass: the verifier "
                                        "needs what it did besides (processes, services); "
                                        "replay and mutation prove nothing here")
            return
        programs = [o for o in outputs if o.program]
        data = [o for o in outputs if not o.program]
        instruction = named_paths(self.task.instruction)
        runs_program = True
        if programs and data:
            only_data = await self.replay(data)
            probes["replay"]["data_only"] = _grade_dict(only_data) | {
                "without": [o.path for o in programs]}
            if only_data.reward is not None and only_data.reward >= 1.0:
                runs_program = False
                asked = [o.path for o in programs
                         if mentions(instruction, o.path, self.workdir)]
                if asked:
                    self.report.add(
                        "verifier_too_weak", "replay",
                        f"writing only the oracle's data outputs "
                        f"({', '.join(o.path for o in data)}) into a fresh sandbox, without "
                        f"the program the instruction asks for ({', '.join(asked)}), scores "
                        f"{only_data.reward:g}: the verifier never runs it")
        await self.mutation_probes(outputs, data, programs, runs_program)

    async def mutation_probes(self, outputs: list[Output], data: list[Output],
                              programs: list[Output], runs_program: bool) -> None:
        verifier = named_paths(verifier_text(self.task.tests_dir))
        targets = data or programs
        chosen = mutation_candidates([o.path for o in targets], verifier, self.workdir)
        read = sorted((o for o in targets if o.path in chosen), key=lambda o: chosen.index(o.path))
        runs = []
        for o in read[:2]:
            for kind, content in mutations(o.data):
                if o.program and kind == "empty":
                    continue  # an empty script still runs: proves nothing
                g = await self.replay(outputs, {o.path: content})
                runs.append({"file": o.path, "mutation": kind, "reward": g.reward,
                             "error": g.error})
                # a data output the verifier may regenerate by running the programs is
                # no proof; a program altered, or data with no program run, is
                if g.reward is not None and g.reward >= 1.0 and \
                        (o.program or not programs or not runs_program):
                    self.report.add("verifier_too_weak", "mutation",
                                    f"the oracle's outputs with {o.path} {kind} still score "
                                    f"{g.reward:g}: the verifier does not check its content")
                    break
        self.report.probes["mutation"] = runs

    # ---------------------------------------------------------------- paths

    def path_probe(self, outputs: list[Output]) -> None:
        verifier = named_paths(verifier_text(self.task.tests_dir))
        instruction = named_paths(self.task.instruction)
        read = [o.path for o in outputs if mentions(verifier, o.path, self.workdir)]
        unnamed = []
        for path in read:
            if mentions(instruction, path, self.workdir, exact=True):
                continue
            other = instruction_names_other(instruction, path)
            if other:
                unnamed.append(f"{path} (the instruction says {other})")
            elif not mentions(instruction, path, self.workdir):
                unnamed.append(path)
        self.report.probes["paths"] = {"verifier_reads": read,
                                       "instruction_names": sorted(instruction[0]),
                                       "not_in_instruction": unnamed}
        if unnamed:
            self.report.add("instruction_verifier_mismatch", "paths",
                            "the verifier reads outputs the instruction does not name: "
                            + "; ".join(unnamed))


def scan_list(files: dict[str, Stat], base: dict[str, Stat] | None,
              settings: ProbeSettings) -> tuple[list[str], int]:
    """The added files the leak scan reads (outside system folders first, then the
    smallest, within ``max_scan_bytes``) and how many it leaves out."""
    def system(p: str) -> bool:
        return p.startswith(SYSTEM) and not p.startswith("/usr/share/doc/")

    new = [p for p in added(files, base) if files[p].size <= settings.max_file_bytes
           and (base is not None or not system(p))]
    new.sort(key=lambda p: (system(p), files[p].size, p))
    chosen, total = [], 0
    for p in new:
        if total + files[p].size > settings.max_scan_bytes:
            break
        chosen.append(p)
        total += files[p].size
    return chosen, len(new) - len(chosen)


def _utf8(path: str) -> bool:
    """Whether a listed path is UTF-8 (others cannot be named in a command to replay)."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _grade_dict(g: Grade) -> dict[str, Any]:
    return {"reward": g.reward, "error": g.error, "metrics": g.metrics,
            "output_tail": g.output[-600:]} | ({"note": g.note} if g.note else {})


__all__ = ["Box", "Finding", "ProbeError", "ProbeReport", "Prober", "scan_list"]
