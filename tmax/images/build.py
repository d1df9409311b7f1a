"""Building the images of a set of tasks into a store: plan, bases, task images, checks."""

from __future__ import annotations

import dataclasses
import datetime
import errno
import json
import logging
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from sandfleet import layers, sif
from tmax.images import installers, layering
from tmax.images.bases import BaseMappingError, BaseTable, default_base_map
from tmax.images.builders import (
    ApptainerBuilder,
    Builder,
    LocalBuilder,
    default_builder,
)
from tmax.images.checks import SandboxImage, image_checker
from tmax.images.plan import task_definition
from tmax.images.rootfs import environment_of
from tmax.images.store import (
    BaseEntry,
    Checks,
    ImageEntry,
    ImageStore,
    LayerFile,
    Manifest,
    default_cache,
    digest_of,
    file_sha256,
    remove_tree,
    tree_digest,
)
from tmax.images.types import (
    DEFAULT_PATH,
    BuildError,
    Definition,
    TaskDefinition,
    labelled_workdir,
    parse_definition,
)
from tmax.images.verifier_scripts import plan as plan_verifier
from tmax.images.verifier_tools import INTERPRETER_BASES, Interpreter, VerifierTools, combine
from tmax.package_data import CONFIGS, IMAGES_DIR
from tmax.tasks import Task
from tmax.tasks.model import NO_BAKED_TESTS
from tmax.tasks.steps import merged_tests

log = logging.getLogger(__name__)
BUILD_FORMAT = "tmax-images-v2"  # bump when builders change what they produce
CHECKS_FORMAT = "checks-v12"  # bump when the checks change what they measure (v2: the
# verifier runs on the image's own PATH, as in rollouts; v3: the image's ENTRYPOINT starts
# first, the verifier gets the image's environment, separate verifiers, oracle after a nop
# verifier error; v4: the ENTRYPOINT is given time to settle; v5: a verifier timeout
# scores 0; v6: git trusts the agent's repositories, /tests is a plain folder; v7: the
# verifier's mount points in the agent's tree are immutable, empty loader files in /etc;
# v8: graded by tmax.tasks.grading.decide, as rollouts: a 0 from a test runner that never
# started is a verifier error, a reward of 1 its test report contradicts scores 0; v9: the
# verifier sees what the agent added to the system folders, sandfleet.verifier.additions;
# v10: what the verifier's scripts install stays hidden, the rest (.pth files too) is seen;
# v11: additions in the standard library's folders are hidden; v12: .pth files with import
# lines hidden again, cmeel's folder put on sys.path by the verifier's sitecustomize)


@dataclass
class BuildResult:
    task_id: str
    status: str  # built | cached | reused (another task's identical image) | failed
    digest: str = ""
    seconds: float = 0.0
    error: str = ""
    log: str = ""
    checks: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    task: Task
    definition: TaskDefinition
    base: str
    base_digest: str
    digest: str
    verifier: VerifierTools
    """What its verifier scripts need prepared in the image (empty: nothing)."""
    verifier_image: TaskDefinition | None = None
    """A separate verifier's image (tests/Dockerfile, tests/ its build context), which then
    gets the verifier tools instead of the task's image."""

    @property
    def user(self) -> str:
        """Who the agent's commands (and the reference solution) run as: the task's [agent]
        user, else its Dockerfile's final USER; "" for root."""
        return _user(self.task.config.agent.user, self.definition.user)

    def verifier_user(self, separate: bool = False) -> str:
        """Who tests/test.sh runs as, as Harbor runs it: the task's [verifier] user, else
        the final USER of the image it runs in (``separate``: the separate verifier's,
        where it has an image of its own); "" for root."""
        image = self.verifier_image if separate and self.verifier_image else self.definition
        return _user(self.task.config.verifier.user, image.user)


def _user(given: str | int | None, image_user: str) -> str:
    """A task's [agent] or [verifier] user, else the image's final USER; "" for root."""
    if given is None:
        return image_user
    return "" if str(given) in ("root", "0", "root:root", "0:0") else str(given)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def checks_inputs(task: Task, verifier_user: str = "") -> str:
    """Digest of what a task's build-time checks read besides its image: tests/,
    solution/, steps/ (a multi-step task's), the verifier, agent and environment settings
    (limits, network) and the steps', and who the verifier runs as where that is not
    root (``Plan.verifier_user``: an image's final USER counts, as checks made when the
    verifier always ran as root did not)."""
    parts = [tree_digest(d) if d.is_dir() else "-" for d in (task.tests_dir,
                                                             task.solution_dir,
                                                             task.root / "steps")]
    settings = json.dumps([task.config.verifier.model_dump(mode="json"),
                           task.config.agent.model_dump(mode="json"),
                           task.config.environment.model_dump(mode="json"),
                           task.config.steps, task.config.multi_step_reward_strategy],
                          sort_keys=True)
    return digest_of(BUILD_FORMAT, CHECKS_FORMAT, *parts, settings,
                     *([f"verifier user {verifier_user}"] if verifier_user else []))


def _sif_lists(path: Path, member: str) -> bool:
    """Whether the SIF's file system has ``member`` (a relative path)."""
    out = subprocess.run(["unsquashfs", "-o", str(sif.read_partition(path).offset), "-l",
                          str(path), member], capture_output=True, text=True, timeout=120,
                         check=False)
    return f"squashfs-root/{member}" in out.stdout.split()


def verifier_plan(task: Task) -> VerifierTools:
    """What the task's verifier scripts need prepared: tests/'s, or, for a multi-step task,
    every step's (its tests/ merged over the task's, as its verifier sees /tests)."""
    if not task.steps:
        return plan_verifier(task.tests_dir)
    with tempfile.TemporaryDirectory(prefix="tmax-steps-") as tmp:
        return combine([
            plan_verifier(merged_tests(task, step, Path(tmp) / str(step.index)))
            for step in task.steps])


class ImageBuilds:
    """Builds and records images; safe to run on several nodes against one store."""

    def __init__(self, store: ImageStore, builder: Builder, *,
                 images_dir: Path = IMAGES_DIR,
                 base_table: Path = CONFIGS / "base-images.yaml",
                 base_map: Path | None = None,
                 checker: Callable[[Task, SandboxImage, Path, SandboxImage | None], Checks]
                 | None = None, layered: bool = True, cache_dir: Path | None = None):
        """``base_map``: a user's map file, tried before ``base_table`` (tmax.images.bases);
        a file that cannot be used raises ``BaseMapError``. ``layered``: task images are
        stored as layers over their base (``tmax.images.layering``; unpacked in
        ``cache_dir``, the node-local cache), else as one SIF each."""
        self.store, self.builder, self.images_dir = store, builder, images_dir
        self.layered, self.cache_dir = layered, Path(cache_dir or default_cache())
        self.bases = BaseTable.load(base_table, user_map=base_map, images_dir=images_dir)
        self.checker = checker
        self._envs: dict[str, dict[str, str]] = {}
        self._failed_bases: dict[str, str] | None = None
        """During build_all: the bases that failed (not retried for each of their tasks)."""

    # ------------------------------------------------------------------ planning

    def base_text(self, base: str) -> str:
        path = self.bases.definition_path(base)
        if not path.is_file():
            raise BuildError(f"base {base}", f"no definition {path}")
        return path.read_text()

    def base_parent(self, base: str) -> str | None:
        """The base a derived base starts from (``Bootstrap: localimage``, ``From: NAME``);
        None for a bootstrapped one."""
        header = parse_definition(self.base_text(base)).header
        if header.get("bootstrap", "").lower() != "localimage":
            return None
        parent = header.get("from", "")
        if not self.bases.definition_path(parent).is_file():
            raise BuildError(f"base {base}", f"{self.bases.definition_path(base)}: 'From: "
                             f"{parent}' names no base (a base name such as debian-slim, "
                             f"with a definition in {self.images_dir} or in the base map)")
        return parent

    def base_chain(self, base: str) -> list[str]:
        """``base`` and its parents, the bootstrapped one first; a cycle is a BuildError."""
        chain = [base]
        while (parent := self.base_parent(chain[-1])) is not None:
            if parent in chain:
                raise BuildError(f"base {base}", "its From: chain is a cycle: "
                                 + " -> ".join([*chain, parent])
                                 + "; one of them must bootstrap (Bootstrap: debootstrap)")
            chain.append(parent)
        return chain[::-1]

    def base_digest(self, base: str) -> str:
        """Covers the definition and, for a derived base, its parent's digest."""
        digest = ""
        for name in self.base_chain(base):
            digest = digest_of(BUILD_FORMAT, "base", name, self.base_text(name),
                               *([digest] if digest else []))
        return digest

    def base_workdir(self, base: str) -> str:
        """Where a base's image starts (its %labels ``org.tmax.workdir``, else a parent's,
        else '/'): a Dockerfile's relative paths start there, as over the real image."""
        for name in reversed(self.base_chain(base)):
            if workdir := labelled_workdir(self.base_text(name)):
                return workdir
        return "/"

    def base_path(self, base: str) -> str:
        """A base's PATH as its image sets it (the %environment of its chain, parent
        first): what a Dockerfile's ``${PATH}`` is over it, as over the real image."""
        return self.base_environment(base).get("PATH", "")

    def base_environment(self, base: str) -> dict[str, str]:
        """The variables a base's image sets (the %environment of its chain, parent
        first)."""
        if base not in self._envs:
            script = "\n".join(parse_definition(self.base_text(name)).sections.get(
                "environment", "") for name in self.base_chain(base))
            self._envs[base] = environment_of(Definition({}, {"environment": script}))
        return self._envs[base]

    def plan(self, task: Task) -> Plan:
        tdef = task_definition(task.environment_dir, self.bases.resolve, self.base_workdir,
                               self.base_path)
        base_digest = self.base_digest(tdef.base)
        verifier = self._with_interpreters(verifier_plan(task))
        if verifier.pip:  # pip lines are prepared for the Python the verifier's PATH finds
            base_path = self.base_path(tdef.base) or DEFAULT_PATH
            verifier = dataclasses.replace(verifier, path=environment_of(
                tdef.definition, base_path).get("PATH") or base_path)
        vdef, separate = None, []
        if task.verifier_definition is not None:
            vdef = task_definition(task.tests_dir, self.bases.resolve, self.base_workdir,
                                   self.base_path)
            separate = ["separate verifier", self.base_digest(vdef.base),
                        *[self.base_digest(b) for b in vdef.stage_bases],
                        vdef.definition.render(), vdef.workdir, tree_digest(task.tests_dir),
                        installers.stamp(installers.find(s for s, _ in vdef.stages))]
        stand_ins = installers.stamp(installers.find(s for s, _ in tdef.stages))
        digest = digest_of(BUILD_FORMAT, "task", base_digest,
                           *[self.base_digest(b) for b in tdef.stage_bases],
                           tdef.definition.render(),
                           tdef.workdir, tree_digest(task.environment_dir),
                           *([verifier.digest_text()] if verifier else []),
                           *([stand_ins] if stand_ins else []), *separate)  # (every stage's)
        return Plan(task, tdef, tdef.base, base_digest, digest, verifier, vdef)

    def _with_interpreters(self, tools: VerifierTools
                           ) -> VerifierTools:
        """``tools`` with an interpreter for each Python version its uv lines ask for that
        a base has (INTERPRETER_BASES), used where the image has none."""
        served = [Interpreter(v, base, self.base_digest(base))
                  for v in tools.pythons
                  if (base := INTERPRETER_BASES.get(v)) and
                  self.bases.definition_path(base).is_file()]
        return dataclasses.replace(tools, interpreters=tuple(served)) if served else tools

    # ------------------------------------------------------------------ bases

    def ensure_base(self, base: str) -> BaseEntry:
        """The store's current entry of ``base``, built (after its parents) when missing."""
        failed = self._failed_bases
        if failed is not None and base in failed:
            raise BuildError(f"base {base}", failed[base])
        digest = self.base_digest(base)
        parent_sif = None
        if parent := self.base_parent(base):
            try:
                parent_sif = self.store.path(self.ensure_base(parent).sif)
            except BuildError as e:
                raise BuildError(f"base {base}", f"over {e}", e.log) from None
        entry = self.store.read().bases.get(base)
        if entry and entry.digest == digest and self.store.path(entry.sif).exists():
            return entry
        with self.store.building(digest):
            entry = self.store.read().bases.get(base)
            if entry and entry.digest == digest and self.store.path(entry.sif).exists():
                return entry  # another builder made it while we waited
            name = f"{base}-{digest}"
            log_rel = f"logs/{name}.log"
            logfile = self.store.path(log_rel)
            logfile.write_text(f"# base {base} digest {digest} builder {self.builder.name}\n")
            tmp = self.store.tmp_path(name)
            tmp.mkdir()
            start = time.monotonic()
            try:
                self.builder.build_base(self.base_text(base), tmp / "image.sif", logfile,
                                        timeout=3600,
                                        **({"parent": parent_sif} if parent_sif else {}))
                size, sha = self.store.publish(tmp / "image.sif", f"bases/{name}.sif")
            except (BuildError, OSError, RuntimeError, sif.SifError, subprocess.SubprocessError) as e:
                if failed is not None:
                    failed[base] = f"failed to build: {e}"
                raise
            finally:
                remove_tree(tmp)
            entry = BaseEntry(name=base, digest=digest, sif=f"bases/{name}.sif", size=size,
                              sha256=sha, builder=self.builder.name, log=log_rel,
                              built_at=now(), build_seconds=round(time.monotonic() - start, 1))
            self.store.update(lambda m: m.bases.__setitem__(base, entry))
            return entry

    # ------------------------------------------------------------------ tasks

    def is_current(self, plan: Plan) -> ImageEntry | None:
        entry = self.store.read().tasks.get(plan.task.task_id)
        if entry and entry.digest == plan.digest and \
                all(self.store.path(f).exists() for f, _, _ in entry.files()):
            return entry
        return None

    def build(self, task: Task, *, force: bool = False, check: bool = True) -> BuildResult:
        """Build one task's image (unless current) and record it; never raises for a
        task's own failure: the result says what went wrong."""
        start = time.monotonic()
        try:
            plan = self.plan(task)
        except (BaseMappingError, BuildError, ValueError) as e:
            return BuildResult(task.task_id, "failed", error=str(e))
        try:
            if not force and (entry := self.is_current(plan)):
                return self._cached(plan, entry, check)
            base = self.ensure_base(plan.base)
            with self.store.building(plan.digest):
                if not force and (entry := self.is_current(plan)):
                    return self._cached(plan, entry, check)
                twin = None if force else self.same_image(plan)
                entry = self._record(plan, twin, start, check) if twin else \
                    self._build_locked(plan, base, start, check)
            return BuildResult(task.task_id, "reused" if twin else "built", plan.digest,
                               round(time.monotonic() - start, 1), log=entry.log,
                               checks=entry.checks.model_dump() if entry.checks else None)
        except BuildError as e:
            return BuildResult(task.task_id, "failed", plan.digest,
                               round(time.monotonic() - start, 1), error=str(e),
                               log=str(e.log or ""))
        except OSError as e:
            reason = "disk full" if e.errno == errno.ENOSPC else str(e)
            return BuildResult(task.task_id, "failed", plan.digest,
                               round(time.monotonic() - start, 1), error=f"{reason} ({e})")
        except (RuntimeError, sif.SifError, subprocess.SubprocessError) as e:
            # a base that will not unpack, a copy that failed: this task fails, others go on
            return BuildResult(task.task_id, "failed", plan.digest,
                               round(time.monotonic() - start, 1), error=str(e))

    def _cached(self, plan: Plan, entry: ImageEntry, check: bool) -> BuildResult:
        """A current image's result; its checks run again when they were made with other
        tests/, solution/ or settings (the image digest covers only what builds it)."""
        if check and self.checker is not None and entry.checks is not None and \
                entry.checks.inputs != checks_inputs(plan.task, plan.verifier_user()):
            entry = entry.model_copy(update={"checks": self._check(plan, entry)})
            self.store.update(lambda m: m.tasks.__setitem__(plan.task.task_id, entry))
        return BuildResult(plan.task.task_id, "cached", plan.digest,
                           checks=entry.checks.model_dump() if entry.checks else None)

    def same_image(self, plan: Plan) -> ImageEntry | None:
        """Another task's entry with this digest (identical environments share one SIF)."""
        for entry in self.store.read().tasks.values():
            if entry.digest == plan.digest and \
                    all(self.store.path(f).exists() for f, _, _ in entry.files()):
                return entry
        return None

    def _record(self, plan: Plan, twin: ImageEntry, start: float, check: bool) -> ImageEntry:
        """This task's entry for an image built for another task (its own checks run)."""
        checks = self._check(plan, twin) if check else None
        entry = twin.model_copy(update={
            "task_id": plan.task.task_id, "built_at": now(), "checks": checks,
            "build_seconds": round(time.monotonic() - start, 1)})
        self.store.update(lambda m: m.tasks.__setitem__(plan.task.task_id, entry))
        return entry

    def sandbox_images(self, plan: Plan, entry: ImageEntry
                       ) -> tuple[SandboxImage, SandboxImage | None]:
        """The task's image and its separate verifier's (None when it has none), as the
        checks start them."""
        image = SandboxImage(self.store.path(entry.sif), entry.workdir,
                             plan.definition.start_command, plan.user, plan.verifier_user())
        vdef = plan.verifier_image
        verifier = SandboxImage(self.store.path(entry.verifier_sif), entry.verifier_workdir,
                                vdef.start_command, vdef.user,
                                plan.verifier_user(separate=True)
                                ) if entry.verifier_sif and vdef else None
        return image, verifier

    def _check(self, plan: Plan, entry: ImageEntry) -> Checks | None:
        if self.checker is None:
            return None
        checks_log = f"logs/{plan.task.task_id}-{plan.digest}.checks.log"
        image, verifier = self.sandbox_images(plan, entry)
        checks = self.checker(plan.task, image, self.store.path(checks_log), verifier)
        checks.log = checks_log
        checks.inputs = checks_inputs(plan.task, plan.verifier_user())
        return checks

    def _build_locked(self, plan: Plan, base: BaseEntry, start: float, check: bool
                      ) -> ImageEntry:
        task_id = plan.task.task_id
        log_rel = f"logs/{task_id}-{plan.digest}.log"
        logfile = self.store.path(log_rel)
        logfile.write_text(f"# task {task_id} digest {plan.digest} base {plan.base} "
                           f"builder {self.builder.name}\n")
        verifier = dataclasses.replace(plan.verifier, interpreters=tuple(
            dataclasses.replace(i, sif=str(self.store.path(self.ensure_base(i.base).sif)))
            for i in plan.verifier.interpreters))
        vdef = plan.verifier_image
        timeout = plan.task.config.environment.build_timeout_sec
        tmp = self.store.tmp_path(plan.digest)
        tmp.mkdir()
        try:
            self.builder.build_task(plan.definition, plan.task.environment_dir,
                                    self.store.path(base.sif), tmp / "image.sif", logfile,
                                    timeout=timeout,
                                    verifier=None if vdef else (verifier or None),
                                    stage_sifs=self._stage_sifs(plan.definition))
            vrel, vsize, vsha = "", 0, ""
            if vdef is not None:  # the separate verifier's image, with the verifier tools
                with open(logfile, "a") as out:
                    out.write(f"# the separate verifier's image: tests/Dockerfile over base "
                              f"{vdef.base}\n")
                vbase = self.store.path(self.ensure_base(vdef.base).sif)
                self.builder.build_task(vdef, plan.task.tests_dir, vbase, tmp / "verifier.sif",
                                        logfile, timeout=timeout, verifier=verifier or None,
                                        stage_sifs=self._stage_sifs(vdef))
                if not _sif_lists(tmp / "verifier.sif", "tests/test.sh"):
                    raise BuildError("separate verifier", NO_BAKED_TESTS, logfile)
                vrel = f"sif/{plan.digest}.verifier.sif"
                vsize, vsha = self.store.publish(tmp / "verifier.sif", vrel)
            if self.layered:
                rel, own = self._publish_layers(plan, base, tmp, logfile, timeout)
                size, sha = self.store.path(rel).stat().st_size, \
                    file_sha256(self.store.path(rel))
            else:
                rel, own = f"sif/{plan.digest}.sif", []
                size, sha = self.store.publish(tmp / "image.sif", rel)
        finally:
            remove_tree(tmp)
        entry = ImageEntry(task_id=task_id, digest=plan.digest, sif=rel, size=size, sha256=sha,
                           base=plan.base, base_digest=plan.base_digest,
                           builder=self.builder.name, log=log_rel, built_at=now(),
                           build_seconds=round(time.monotonic() - start, 1),
                           workdir=plan.definition.workdir, verifier_sif=vrel,
                           verifier_workdir=vdef.workdir if vdef else "", verifier_size=vsize,
                           verifier_sha256=vsha, layers=own)
        entry.checks = self._check(plan, entry) if check else None

        def record(m: Manifest) -> None:
            m.tasks[task_id] = entry
            for other in m.tasks.values():  # a forced rebuild replaced a shared file
                if other.sif == rel:
                    other.size, other.sha256 = size, sha
                if vrel and other.verifier_sif == vrel:
                    other.verifier_size, other.verifier_sha256 = vsize, vsha

        self.store.update(record)
        return entry

    def _publish_layers(self, plan: Plan, base: BaseEntry, tmp: Path, logfile: Path,
                        timeout: float) -> tuple[str, list[LayerFile]]:
        """The built ``tmp/image.sif`` split over its base, its layers published (one file
        per distinct layer), its layers file written; (its path, its layers)."""
        try:
            built, found = layering.split_sif(tmp / "image.sif", self.store.path(base.sif),
                                              self.cache_dir, tmp, timeout, plan.verifier.path)
        except BuildError as e:
            raise BuildError(e.what, e.reason, logfile) from None
        own = [self.store.publish_layer(built[0])]
        if len(built) > 1:  # the verifier tools: one layer for every task that has the
            # same tools, base and Pythons (pip lines install against the image's own
            # packages: those stay the task's)
            shared = not plan.verifier.pip and plan.verifier_image is None
            tools = dataclasses.replace(plan.verifier, apt=(), apt_where=())  # (those go to
            # the task's own layer; the Pythons they add are in ``found``)
            key = digest_of(layering.TOOLS_FORMAT, layering.tools_key_text(tools.digest_text()),
                            base.digest, json.dumps(found)) if shared else ""
            own.append(self.store.publish_layer(built[1], f"tools-{key}" if key else ""))
        rel = f"sif/{plan.digest}.layers"
        layers.write(self.store.path(rel), [self.store.path(la.path) for la in own] +
                     [self.store.path(base.sif)])
        with open(logfile, "a") as out:
            out.write("# layers over base " + base.name + ": " + ", ".join(
                f"{la.path} ({la.size / 2**20:.2f} MB)" for la in own) + "\n")
        return rel, own

    def _stage_sifs(self, tdef: TaskDefinition) -> dict[str, Path]:
        """The SIF of each base an earlier Dockerfile stage starts from (built if need be)."""
        return {b: self.store.path(self.ensure_base(b).sif) for b in tdef.stage_bases}

    def build_all(self, tasks: list[Task], *, jobs: int = 2, force: bool = False,
                  check: bool = True, progress: bool = True) -> list[BuildResult]:
        """Build every task's image, ``jobs`` at a time, with a progress bar; the bases
        first (parents before derived bases); a base that fails is tried once, and its
        tasks fail with its error."""
        self._failed_bases = {}
        try:
            return self._build_all(tasks, jobs, force, check, progress)
        finally:
            self._failed_bases = None

    def _build_all(self, tasks: list[Task], jobs: int, force: bool, check: bool,
                   progress: bool) -> list[BuildResult]:
        plans_ok = []
        for task in tasks:
            try:
                plan = self.plan(task)
                plans_ok += [*plan.definition.stage_bases, plan.base]
            except (BaseMappingError, BuildError, ValueError):
                pass  # reported by build()
        for base in dict.fromkeys(plans_ok):  # bases first, once each, in order
            try:
                self.ensure_base(base)
            except (BuildError, OSError, RuntimeError, sif.SifError, subprocess.SubprocessError) as e:
                log.error("%s", e)  # its tasks fail with it (build() says so), not retried
        with ThreadPoolExecutor(max(1, jobs)) as pool, \
                tqdm(total=len(tasks), desc="images", unit="image", disable=not progress) as bar:
            futures = [pool.submit(self.build, t, force=force, check=check) for t in tasks]
            for fut in as_completed(futures):
                bar.set_postfix_str(f"{fut.result().task_id}: {fut.result().status}")
                bar.update(1)
        return [f.result() for f in futures]


def open_builds(store: str | Path, *, builder: str = "auto", mirror: str | None = None,
                check: bool = True, cache_dir: str | Path | None = None,
                base_map: str | Path | None = None, layered: bool = True) -> ImageBuilds:
    """An ``ImageBuilds`` over ``store`` with the named builder (and build-time checks);
    ``base_map`` (else $TMAX_BASE_MAP) is a user's map of images to bases, tried first.
    Builds and runs must see the same map: it decides the bases, hence the digests."""
    cache = Path(cache_dir or default_cache())
    chosen: Builder = {"auto": lambda: default_builder(cache, mirror),
              "apptainer": lambda: ApptainerBuilder(mirror=mirror),
              "local": lambda: LocalBuilder(cache, mirror)}[builder]()
    checker = image_checker(cache) if check else None
    return ImageBuilds(ImageStore(store), chosen, checker=checker,
                       base_map=default_base_map(base_map), layered=layered, cache_dir=cache)
