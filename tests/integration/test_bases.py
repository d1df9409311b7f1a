"""Local bases for registry images: normalisation, the shipped table, a user's map, derived
bases (digest and parent-first builds), the apt mirror of other Debian releases."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.unit.test_tasks import make_task, run_cli
from tmax.images.bases import (
    BASE_MAP_ENV,
    BaseMapError,
    BaseMappingError,
    BaseTable,
    default_base_map,
    normalize,
)
from tmax.images.build import ImageBuilds
from tmax.images.plan import task_definition
from tmax.images.rootfs import apt_mirror
from tmax.images.store import ImageStore
from tmax.images.types import BuildError, parse_definition
from tmax.tasks import load_task

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "configs" / "base-images.yaml"
IMAGES = REPO / "tmax" / "images" / "data"  # shipped in the package (images/ links to it)


# --------------------------------------------------------------------------- normalisation


@pytest.mark.parametrize("image, base", [
    # FROM lines as real benchmark tasks write them
    ("python:3.11-slim", "debian-slim"),
    ("python:3.10-slim-bullseye", "debian-slim"),
    ("python:3.9", "buildpack-deps-bookworm"),  # the full tags: buildpack-deps + Python
    ("python:3.9-slim", "debian-slim"),
    ("python:3.12.7-slim-bookworm", "python-3.12"),
    ("python:3.13-slim", "debian-trixie"),
    ("python:3", "buildpack-deps-trixie"),
    ("python:3-slim", "debian-trixie"),
    ("python:3.13-alpine", "debian-trixie"),
    ("docker.io/library/python:3.11-slim@sha256:" + "ab" * 32, "debian-slim"),
    ("docker.io/python:3.12", "python-3.12"),
    # a tag that names Debian 12 gets bookworm (its Dockerfile pins bookworm's packages)
    ("index.docker.io/library/python:3.13-bookworm", "python-3.13-bookworm"),
    ("public.ecr.aws/docker/library/python:3.13-slim-bookworm@sha256:" + "f5" * 32,
     "python-3.13-slim-bookworm"),  # no compiler, as the slim image
    ("python:3.14.1-slim-bookworm", "python-3.13-slim-bookworm"),
    ("python:bookworm", "python-3.13-bookworm"),
    ("python:3-slim-bookworm", "python-3.13-slim-bookworm"),
    ("python:3-bookworm", "python-3.13-bookworm"),
    ("python:slim-bookworm", "python-3.13-slim-bookworm"),
    ("python:3.10-slim-bookworm", "debian-slim"),
    ("python:3.13-slim-trixie", "debian-trixie"),
    ("library/python:3.10", "buildpack-deps-bookworm"),
    ("mirror.gcr.io/library/python:3.11", "buildpack-deps-bookworm"),
    ("mirror.gcr.io/library/python:3.11-slim", "debian-slim"),
    # ruby: digest-pinned, through a registry's mirror of Docker Hub
    ("ruby:3.3-slim", "ruby-3.3-slim"),
    ("ruby:3.3.5-slim", "ruby-3.3-slim"),
    ("ruby:3.3.5-slim-bookworm", "ruby-3.3-slim"),
    ("ruby:3.3-slim@sha256:" + "5e" * 32, "ruby-3.3-slim"),
    ("docker.io/library/ruby:3.3.5-slim@sha256:" + "5e" * 32, "ruby-3.3-slim"),
    ("some.mirror/library/ruby:3.3-slim", "ruby-3.3-slim"),
    ("registry.example:5000/library/ruby:3.3.5-slim", "ruby-3.3-slim"),
    ("public.ecr.aws/docker/library/node:20.18.1-bookworm", "node-bookworm"),
    ("node:22-bookworm-slim", "node-bookworm"),
    ("node:22-trixie-slim", "node"),
    ("node:18-slim", "node"),
    ("golang:1.22-bookworm", "golang-bookworm"),
    ("public.ecr.aws/docker/library/golang:1.22.7-bookworm", "golang-bookworm"),
    ("golang:1.24", "golang"),
    ("golang:bookworm", "golang-bookworm"),
    ("rust:1.83-slim", "rust"),
    ("ubuntu:24.04", "ubuntu-noble"),
    ("ubuntu:noble-20240605", "ubuntu-noble"),
    ("ubuntu", "ubuntu-noble"),  # latest
    ("ubuntu@sha256:" + "0f" * 32, "ubuntu-noble"),  # a digest only: latest
    ("ubuntu:22.04", "ubuntu-jammy"),
    ("ubuntu:jammy", "ubuntu-jammy"),
    ("ubuntu:20.04", "ubuntu-jammy"),
    ("debian:bookworm-slim", "debian-slim"),
    ("debian:trixie-slim", "debian-trixie"),
    ("debian:stable-slim", "debian-trixie"),
    ("buildpack-deps:jammy", "buildpack-deps-jammy"),
    ("buildpack-deps:bookworm-scm", "buildpack-deps-bookworm"),
    ("buildpack-deps:noble", "buildpack-deps-trixie"),
    ("gcc:12.4", "buildpack-deps-bookworm"),
    ("gcc:14", "buildpack-deps-trixie"),
    ("gcc:13.3.0-bookworm", "buildpack-deps-bookworm"),  # a real TB2 task pins bookworm's
    ("gcc:12-trixie", "buildpack-deps-trixie"),
    ("eclipse-temurin:17-jdk", "java-17"),
    ("openjdk:17-slim", "java-17"),
    ("eclipse-temurin:21-jdk-jammy", "java-21"),
    ("public.ecr.aws/docker/library/maven:3.9.9-eclipse-temurin-21@sha256:" + "3a" * 32,
     "maven-21"),  # (a real Terminus task)
    ("maven:3.9-amazoncorretto-21-alpine", "maven-21"),
    ("maven:3.9.11", "maven-21"),
    ("ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624", "t-bench-ubuntu"),
    ("ghcr.io/laude-institute/t-bench/python-3-13:20250620", "t-bench"),
    ("jupyter/scipy-notebook", "debian-datasci"),
    ("continuumio/miniconda3:24.7.1-0", "debian-datasci"),
    ("  --platform=linux/amd64   python:3.11-slim  ", "debian-slim"),
])
def test_real_from_lines_map_to_their_family(image, base):
    assert BaseTable.load(TABLE).resolve(image) == base


@pytest.mark.parametrize("image, ref", [
    ("python", "python:latest"),
    ("docker.io/library/python:3.12@sha256:" + "ab" * 32, "python:3.12"),
    ("public.ecr.aws/docker/library/node:20", "node:20"),
    ("ghcr.io/laude-institute/t-bench/ubuntu-24-04",
     "ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest"),
    ("localhost:5000/team/tool", "localhost:5000/team/tool:latest"),  # a port is no tag
    ("localhost:5000/team/tool:1.2", "localhost:5000/team/tool:1.2"),
    ("some.mirror/library/ruby:3.3-slim", "ruby:3.3-slim"),  # any registry's mirror of Hub
    ("localhost:5000/library/ruby", "ruby:latest"),
    ("someuser/library:1", "someuser/library:1"),  # a Hub user, not a registry
    ("quay.io/jupyter/base-notebook:2024", "quay.io/jupyter/base-notebook:2024"),
    ("", ""),
])
def test_normalize(image, ref):
    assert normalize(image) == ref


@pytest.mark.parametrize("image", ["alpine:3.19", "python:2.7", "eclipse-temurin:11",
                                   "ruby:3.3", "ruby:3.2-slim",
                                   "maven:3.9.9-eclipse-temurin-17",
                                   "ghcr.io/other/thing:1", ""])
def test_images_we_cannot_stand_in_for_stay_unmapped(image):
    with pytest.raises(BaseMappingError):
        BaseTable.load(TABLE).resolve(image)


def test_every_shipped_base_is_mapped_documented_and_bootstraps():
    """Each images/*.def is mapped to (or the parent of one that is), says what it stands in
    for and how it differs, and its From: chain ends in a debootstrap."""
    table = BaseTable.load(TABLE)
    defs = {p.stem: p.read_text() for p in IMAGES.glob("*.def")}
    parents = {}
    for name, text in defs.items():
        header = parse_definition(text).header
        assert "Stands in for" in text and "Differs from" in text, name
        if header["bootstrap"] == "localimage":
            assert header["from"] in defs, name
            parents[name] = header["from"]
        else:
            assert header["bootstrap"] == "debootstrap" and "{{ MIRROR }}" in text, name
    mapped = {m.base for m in table.mappings}
    assert set(defs) <= mapped | set(parents.values())
    for name in defs:
        seen = [name]
        while seen[-1] in parents:
            seen.append(parents[seen[-1]])
            assert len(seen) < 5, seen


def test_base_table_rejects_unknown_keys(tmp_path):
    bad = tmp_path / "t.yaml"
    bad.write_text("mappings:\n  - {image: 'x:*', base: y, colour: red}\n")
    with pytest.raises(ValueError, match=r"t.yaml: mappings\[0\] needs exactly"):
        BaseTable.load(bad)
    bad.write_text("mappings: []\nextra: 1\n")
    with pytest.raises(BaseMapError, match=r"t.yaml: unknown keys \['extra'\]"):
        BaseTable.load(bad)


def test_shipped_table_base_needs_a_definition(tmp_path):
    table = tmp_path / "t.yaml"
    table.write_text("mappings:\n  - {image: 'x:*', base: nowhere}\n")
    with pytest.raises(BaseMapError, match=r"mappings\[0\] names base 'nowhere'.*nowhere.def"):
        BaseTable.load(table)


# --------------------------------------------------------------------------- unmapped


def test_unmapped_image_is_one_clear_error(tmp_path):
    task = make_task(tmp_path, **{"environment/Dockerfile": "FROM docker.io/library/alpine:3.19\n"})
    with pytest.raises(BaseMappingError) as info:
        task_definition(task / "environment", BaseTable.load(TABLE).resolve)
    e = info.value
    assert e.image == "docker.io/library/alpine:3.19" and e.table == TABLE
    first, *families = str(e).splitlines()
    # the first line (what `tmax eval` lists per skipped task) says what to do
    assert "'docker.io/library/alpine:3.19' (read as alpine:3.19)" in first
    assert "--base-map FILE" in first and BASE_MAP_ENV in first and str(TABLE) in first
    listed = {line.split(":")[0].strip() for line in families}
    assert listed == {p.stem for p in IMAGES.glob("*.def")}
    assert any(line.startswith("  node: node:*") for line in families)
    assert any("ubuntu:24.04*" in line for line in families if "ubuntu-noble" in line)


# --------------------------------------------------------------------------- user map


def write_map(path: Path, *entries: str) -> Path:
    path.write_text("mappings:\n" + "".join(f"  - {e}\n" for e in entries))
    return path


def test_user_map_is_tried_first_and_may_name_its_own_def(tmp_path):
    (tmp_path / "defs").mkdir()
    (tmp_path / "defs" / "my-tools.def").write_text(
        "# mine\nBootstrap: localimage\nFrom: debian-slim\n\n%post\n    true\n")
    user = write_map(tmp_path / "map.yaml",
                     "{image: 'python:3.11*', base: debian-trixie}",
                     "{image: 'corp.example/tools:*', base: defs/my-tools.def}")
    table = BaseTable.load(TABLE, user_map=user)
    assert table.resolve("python:3.11-slim") == "debian-trixie"  # the user's wins
    assert table.resolve("python:3.10-slim") == "debian-slim"  # the shipped table after it
    assert table.resolve("corp.example/tools:7") == "my-tools"
    assert table.definition_path("my-tools") == (tmp_path / "defs" / "my-tools.def").resolve()
    assert table.definition_path("golang") == IMAGES / "golang.def"
    with pytest.raises(BaseMappingError, match=f"your map {user}"):
        table.resolve("alpine:3")
    builds = ImageBuilds(ImageStore(tmp_path / "store"), FakeBuilder(), layered=False,
                         base_map=user)
    assert builds.base_chain("my-tools") == ["debian-slim", "my-tools"]
    assert builds.base_text("my-tools").startswith("# mine")


@pytest.mark.parametrize("entries, match", [
    (["{image: 'x:*', base: nope}"],
     r"mappings\[0\] \(image 'x:\*'\): base 'nope' is neither a shipped base \(.*\) nor a .def"),
    (["{image: 'x:*', base: debian-slim}", "{image: 'y:*', base: gone.def}"],
     r"mappings\[1\] \(image 'y:\*'\): base file .*gone.def does not exist"),
    (["{image: 'x:*', base: golang.def}"], r"mappings\[0\].*has the name 'golang' of another"),
    (["{image: 'x:*', base: bad.def}"], r"mappings\[0\].*bad.def needs 'Bootstrap: debootstrap'"),
    (["{image: 'x:*'}"], r"mappings\[0\] needs exactly 'image' and 'base'"),
    (["{image: '', base: debian-slim}"], r"mappings\[0\] needs exactly .*non-empty"),
])
def test_bad_user_map_names_the_file_and_entry(tmp_path, entries, match):
    (tmp_path / "golang.def").write_text("Bootstrap: localimage\nFrom: debian-slim\n")
    (tmp_path / "bad.def").write_text("Bootstrap: docker\nFrom: alpine\n")
    user = write_map(tmp_path / "map.yaml", *entries)
    with pytest.raises(BaseMapError, match=str(user).replace(".", r"\.") + ": " + match):
        BaseTable.load(TABLE, user_map=user)


@pytest.mark.parametrize("text, match", [
    ("mappings: [", "not YAML"),
    ("- a\n- b\n", "unknown keys list"),
    ("mappings: {image: x}\n", "'mappings' must be a list"),
])
def test_unreadable_user_map(tmp_path, text, match):
    user = tmp_path / "map.yaml"
    user.write_text(text)
    with pytest.raises(BaseMapError, match=match):
        BaseTable.load(TABLE, user_map=user)
    with pytest.raises(BaseMapError, match="cannot read it"):
        BaseTable.load(TABLE, user_map=tmp_path / "missing.yaml")


def test_default_base_map_option_then_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(BASE_MAP_ENV, raising=False)
    assert default_base_map(None) is None
    monkeypatch.setenv(BASE_MAP_ENV, str(tmp_path / "env.yaml"))
    assert default_base_map(None) == tmp_path / "env.yaml"
    assert default_base_map(str(tmp_path / "opt.yaml")) == tmp_path / "opt.yaml"


def test_cli_base_map_is_used_and_a_bad_one_is_one_error(tmp_path, monkeypatch):
    monkeypatch.delenv(BASE_MAP_ENV, raising=False)
    task = make_task(tmp_path / "tasks", **{"environment/Dockerfile": "FROM alpine:3.19\n"})
    bad = write_map(tmp_path / "bad.yaml", "{image: 'alpine:*', base: nope}")
    res = run_cli("images", "build", task, "--store", tmp_path / "store", "--base-map", bad,
                  "--no-check", "--builder", "local")
    assert res.exit_code == 1 and f"{bad}: mappings[0]" in res.output, res.output
    monkeypatch.setenv(BASE_MAP_ENV, str(bad))  # the environment variable, same check
    res = run_cli("images", "build", task, "--store", tmp_path / "store", "--no-check")
    assert res.exit_code == 1 and f"{bad}: mappings[0]" in res.output, res.output
    res = run_cli("eval", "--tasks", task, "--policy", "nop", "--store", tmp_path / "store",
                  "--base-map", bad)
    assert res.exit_code == 1 and f"{bad}: mappings[0]" in res.output, res.output


# --------------------------------------------------------------------------- derived bases


class FakeBuilder:
    """Records build_base calls; 'builds' a file naming the definition's first line."""

    name = "fake"

    def __init__(self, fail: set[str] = frozenset()):
        self.calls: list[tuple[str, Path | None]] = []
        self.fail = fail

    def build_base(self, definition_text: str, out: Path, log: Path, timeout: float,
                   parent: Path | None = None) -> None:
        name = definition_text.splitlines()[0].lstrip("# ")
        self.calls.append((name, parent))
        if name in self.fail:
            raise BuildError("%post", f"{name} broke", log)
        out.write_text(f"{name} over {parent}\n")

    def build_task(self, task, env_dir, base_sif, out, log, timeout, verifier=None,
                   stage_sifs=None) -> None:
        out.write_text(f"task over {base_sif}\n")


def family(tmp_path: Path, **defs: str) -> tuple[Path, Path]:
    """An images dir with ``name=parent`` defs ("" bootstraps) and a table mapping
    ``<name>:*`` to each."""
    images = tmp_path / "images"
    images.mkdir(exist_ok=True)
    for name, parent in defs.items():
        head = f"Bootstrap: localimage\nFrom: {parent}\n" if parent else \
            "Bootstrap: debootstrap\nOSVersion: bookworm\nMirrorURL: {{ MIRROR }}\n"
        (images / f"{name}.def").write_text(f"# {name}\n{head}\n%post\n    echo {name}\n")
    table = write_map(tmp_path / "table.yaml",
                      *(f"{{image: '{n}:*', base: {n}}}" for n in defs))
    return images, table


def test_derived_digest_covers_the_parent(tmp_path):
    images, table = family(tmp_path, root="", mid="root", leaf="mid", other="")
    builds = ImageBuilds(ImageStore(tmp_path / "store"), FakeBuilder(), layered=False,
                         images_dir=images,
                         base_table=table)
    before = {n: builds.base_digest(n) for n in ("root", "mid", "leaf", "other")}
    assert builds.base_chain("leaf") == ["root", "mid", "leaf"]
    (images / "root.def").write_text((images / "root.def").read_text() + "    echo v2\n")
    after = {n: builds.base_digest(n) for n in ("root", "mid", "leaf", "other")}
    assert all(before[n] != after[n] for n in ("root", "mid", "leaf"))
    assert before["other"] == after["other"]
    (images / "leaf.def").write_text((images / "leaf.def").read_text() + "    echo v2\n")
    assert builds.base_digest("mid") == after["mid"] != builds.base_digest("leaf")


def test_ensure_base_builds_parents_first_and_once(tmp_path):
    images, table = family(tmp_path, root="", mid="root", leaf="mid")
    store = ImageStore(tmp_path / "store")
    fake = FakeBuilder()
    builds = ImageBuilds(store, fake, layered=False, images_dir=images, base_table=table)
    leaf = builds.ensure_base("leaf")
    bases = store.read().bases
    assert fake.calls == [("root", None), ("mid", store.path(bases["root"].sif)),
                          ("leaf", store.path(bases["mid"].sif))]
    assert store.path(leaf.sif).read_text() == f"leaf over {store.path(bases['mid'].sif)}\n"
    builds.ensure_base("leaf")
    builds.ensure_base("mid")
    assert len(fake.calls) == 3  # all current: nothing rebuilt
    (images / "mid.def").write_text((images / "mid.def").read_text() + "    echo v2\n")
    builds.ensure_base("leaf")
    assert [c[0] for c in fake.calls[3:]] == ["mid", "leaf"]  # root stays


def test_cycles_and_unknown_parents_are_clear_errors(tmp_path):
    images, table = family(tmp_path, a="b", b="c", c="a", d="nowhere")
    builds = ImageBuilds(ImageStore(tmp_path / "store"), FakeBuilder(), layered=False,
                         images_dir=images,
                         base_table=table)
    with pytest.raises(BuildError, match="cycle: a -> b -> c -> a"):
        builds.ensure_base("a")
    with pytest.raises(BuildError, match=r"d.def: 'From: nowhere' names no base"):
        builds.base_digest("d")
    assert builds.builder.calls == []


def test_build_all_builds_derived_bases_first_and_a_broken_one_once(tmp_path):
    images, table = family(tmp_path, root="", good="root", broken="root", child="broken")
    fake = FakeBuilder(fail={"broken"})
    builds = ImageBuilds(ImageStore(tmp_path / "store"), fake, layered=False,
                         images_dir=images,
                         base_table=table)
    tasks = [load_task(make_task(tmp_path / "tasks", f"t{i}", **{
        "environment/Dockerfile": f"FROM {base}:1\nWORKDIR /app\n"}))
        for i, base in enumerate(["good", "child", "child", "broken"])]
    results = {r.task_id: r for r in builds.build_all(tasks, jobs=2, check=False,
                                                      progress=False)}
    assert [c[0] for c in fake.calls] == ["root", "good", "broken"]  # broken: tried once
    assert results["t0"].status == "built"
    for tid in ("t1", "t2", "t3"):
        assert results[tid].status == "failed" and "broken broke" in results[tid].error
    assert "base child" in results["t1"].error and "base broken" in results["t3"].error


# --------------------------------------------------------------------------- apt mirror


def test_apt_mirror_of_an_unlisted_release_is_a_listed_releases(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://sec.example/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\nURIs: http://mirror.example/debian/\nSuites: bookworm bookworm-updates\n")
    (tmp_path / "sources.list.d" / "vendor.list").write_text(
        "deb https://vendor.example/apt cloud-sdk-bookworm main\n")
    assert apt_mirror("bookworm", tmp_path) == "http://mirror.example/debian"
    assert apt_mirror("trixie", tmp_path) == "http://mirror.example/debian"
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://sec.example/debian-security\nSuites: bookworm-security\n")
    with pytest.raises(BuildError, match="no deb source for suite 'trixie' .*--mirror"):
        apt_mirror("trixie", tmp_path)  # neither security nor a vendor's archive will do


def test_ubuntu_bases_take_ubuntus_archive_not_the_debian_mirror(tmp_path, monkeypatch):
    from tmax.images import rootfs
    from tmax.images.builders import _mirror_for

    monkeypatch.delenv(rootfs.UBUNTU_MIRROR_ENV, raising=False)
    (tmp_path / "sources.list").write_text("deb http://mirror.example/debian bookworm main\n")
    monkeypatch.setattr(rootfs.platform, "machine", lambda: "x86_64")
    assert apt_mirror("noble", tmp_path) == "http://archive.ubuntu.com/ubuntu"
    monkeypatch.setattr(rootfs.platform, "machine", lambda: "aarch64")
    assert apt_mirror("jammy", tmp_path) == "http://ports.ubuntu.com/ubuntu-ports"
    (tmp_path / "sources.list").write_text("deb [arch=amd64] http://ubuntu.example/ubuntu/ "
                                           "jammy main\n")  # an Ubuntu host's own archive
    assert apt_mirror("noble", tmp_path) == "http://ubuntu.example/ubuntu"
    monkeypatch.setenv(rootfs.UBUNTU_MIRROR_ENV, "http://local.example/ubuntu/")
    assert apt_mirror("noble", tmp_path) == "http://local.example/ubuntu"
    # --mirror is Debian's: an Ubuntu base keeps Ubuntu's archive
    noble, slim = (IMAGES / "ubuntu-noble.def").read_text(), (IMAGES / "debian-slim.def").read_text()
    assert _mirror_for(noble, "http://mirror.example/debian") == "http://local.example/ubuntu"
    assert _mirror_for(slim, "http://mirror.example/debian") == "http://mirror.example/debian"


def _fake_debootstrap(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # it makes the target (the absolute path that is not there yet), never the suite's name
    # in the current directory
    (bin_dir / "debootstrap").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGV_FILE"\n'
                                         'for a; do case "$a" in /*) [ -e "$a" ] || '
                                         'mkdir -p "$a";; esac; done; exit 0\n')
    (bin_dir / "debootstrap").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("ARGV_FILE", str(tmp_path / "argv"))


def test_ubuntu_debootstrap_is_checked_with_ubuntus_keyring(tmp_path, monkeypatch):
    """A release newer than the host's debootstrap knows gets the script every Ubuntu
    release uses, and the Release file is checked against Ubuntu's keyring."""
    from tmax.images import rootfs

    _fake_debootstrap(tmp_path, monkeypatch)
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "gutsy").write_text("")
    monkeypatch.setattr(rootfs, "DEBOOTSTRAP_SCRIPTS", scripts)
    definition = parse_definition("Bootstrap: debootstrap\nOSVersion: noble\n"
                                  "Include: python3 ca-certificates\n")
    dest = tmp_path / "root"
    rootfs.debootstrap_base(definition, dest, "http://u.example/ubuntu", tmp_path / "log",
                            keyring=Path("/k/ubuntu.gpg"))
    assert (tmp_path / "argv").read_text().split("\n")[:-1] == [
        "--variant=minbase", "--include=python3,ca-certificates", "--keyring=/k/ubuntu.gpg",
        "noble", str(dest), "http://u.example/ubuntu", str(scripts / "gutsy")]
    (scripts / "noble").write_text("")  # a debootstrap that knows it: its own script
    rootfs.debootstrap_base(definition, tmp_path / "root2", "http://u.example/ubuntu",
                            tmp_path / "log", keyring=Path("/k/ubuntu.gpg"))
    assert (tmp_path / "argv").read_text().split("\n")[-2] == "http://u.example/ubuntu"


def test_ubuntu_keyring_is_fetched_once_and_only_when_its_digest_is_pinned(tmp_path,
                                                                           monkeypatch):
    import hashlib
    import http.server
    import subprocess
    import threading

    from tmax.images import rootfs

    pkg = tmp_path / "pkg"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "DEBIAN" / "control").write_text(
        "Package: ubuntu-keyring\nVersion: 1\nArchitecture: all\nMaintainer: t <t@t>\n"
        "Description: test\n")
    (pkg / "usr/share/keyrings").mkdir(parents=True)
    (pkg / "usr/share/keyrings/ubuntu-archive-keyring.gpg").write_bytes(b"KEYS")
    served = tmp_path / "www" / "pool"
    served.mkdir(parents=True)
    subprocess.run(["dpkg-deb", "--build", "-Zgzip", str(pkg), str(served / "k.deb")],
                   check=True, capture_output=True)
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(  # noqa: E731
        *a, directory=str(tmp_path / "www"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    mirror = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(rootfs, "UBUNTU_KEYRING", tmp_path / "absent.gpg")
    log = tmp_path / "log"
    try:
        monkeypatch.setattr(rootfs, "UBUNTU_KEYRING_DEB", ("pool/k.deb", "0" * 64))
        with pytest.raises(BuildError, match="not the expected package"):
            rootfs.ubuntu_keyring(tmp_path / "cache", mirror, log)
        assert not (tmp_path / "cache" / "keyrings" / "ubuntu-archive-keyring.gpg").exists()
        digest = hashlib.sha256((served / "k.deb").read_bytes()).hexdigest()
        monkeypatch.setattr(rootfs, "UBUNTU_KEYRING_DEB", ("pool/k.deb", digest))
        kept = rootfs.ubuntu_keyring(tmp_path / "cache", mirror, log)
        assert kept == tmp_path / "cache" / "keyrings" / "ubuntu-archive-keyring.gpg"
        assert kept.read_bytes() == b"KEYS"
    finally:
        server.shutdown()
        server.server_close()
    assert rootfs.ubuntu_keyring(tmp_path / "cache", mirror, log) == kept  # no server now
    with pytest.raises(BuildError, match="cannot fetch .*ubuntu-keyring"):
        rootfs.ubuntu_keyring(tmp_path / "other", mirror, log)
    host = tmp_path / "host.gpg"
    host.write_bytes(b"HOST")
    monkeypatch.setattr(rootfs, "UBUNTU_KEYRING", host)  # an Ubuntu host's own keyring
    assert rootfs.ubuntu_keyring(tmp_path / "other", mirror, log) == host


def test_apptainer_refuses_an_ubuntu_base_it_could_not_check(tmp_path, monkeypatch):
    from tmax.images import builders

    monkeypatch.setattr(builders, "UBUNTU_KEYRING", tmp_path / "absent.gpg")
    with pytest.raises(BuildError, match="Ubuntu's archive keyring at .*ubuntu-keyring"):
        builders.ApptainerBuilder(apptainer="/nonexistent/apptainer").build_base(
            (IMAGES / "ubuntu-noble.def").read_text(), tmp_path / "out.sif", tmp_path / "log",
            timeout=60)


# --------------------------------------------------------------------------- a real build


@pytest.mark.slow
@pytest.mark.sandbox
def test_local_builder_builds_a_derived_base_over_the_slim_base(image_store, tmp_path):
    """A user's derived base (From: debian-slim, apt-get install in %post) built for real by
    the local builder over the slim base already in the store: its package is in the SIF,
    with the file owners dpkg gives it."""
    import subprocess

    from sandfleet.runtime import sif
    from tmax.images.builders import LocalBuilder

    (tmp_path / "tmux.def").write_text(
        "# tmux over debian-slim\nBootstrap: localimage\nFrom: debian-slim\n\n%post\n"
        "    export DEBIAN_FRONTEND=noninteractive\n    apt-get update\n"
        "    apt-get install -y --no-install-recommends tmux\n"
        "    rm -rf /var/lib/apt/lists/*\n\n%environment\n    export TMUX_TEST=1\n")
    user = write_map(tmp_path / "map.yaml", "{image: 'tmux-test:*', base: tmux.def}")
    builds = ImageBuilds(image_store, LocalBuilder(Path.home() / ".cache" / "tmax"),
                         base_map=user)
    slim = image_store.read().bases["debian-slim"]
    entry = builds.ensure_base(builds.bases.resolve("tmux-test:1"))
    assert image_store.read().bases["debian-slim"] == slim  # the parent was reused
    root = tmp_path / "root"
    sif.extract(image_store.path(entry.sif), root)
    assert (root / "usr/bin/tmux").is_file() and (root / "usr/bin/python3").exists()
    helper = root / "usr/lib/x86_64-linux-gnu/utempter/utempter"
    if helper.exists():  # group utmp, as dpkg set it (a build namespace that maps it)
        assert helper.stat().st_gid != 0
    env = (root / ".singularity.d/env/90-environment.sh").read_text()
    assert "LC_ALL=C.UTF-8" in env and "TMUX_TEST=1" in env  # the parent's, then its own
    subprocess.run(["rm", "-rf", "--one-file-system", str(root)], check=False, timeout=120)
