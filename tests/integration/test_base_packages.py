"""A stand-in holds what its registry image holds (images/packages.yaml): the file against
the table and the definitions, the comparison, and the bases CI builds (python:3.13-slim-
bookworm's and ruby:3.3-slim's) read back from their dpkg status; Dockerfiles over them
that the real images build."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.unit.test_tasks import make_task
from tmax.images.base_packages import (
    PACKAGES_FILE,
    Expectation,
    PackagesFileError,
    check_file,
    dpkg_installed,
    load_expectations,
    problems,
    sif_installed,
)
from tmax.images.bases import SHIPPED_TABLE, BaseTable

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"


def test_the_file_agrees_with_the_table_and_the_definitions():
    """Every entry's image resolves to the base it names, every shipped base has an entry,
    and no definition installs by name a package its image lacks unless that is listed."""
    expectations = load_expectations()
    assert check_file(expectations, BaseTable.load(SHIPPED_TABLE)) == []
    by_image = {e.image: e for e in expectations}
    slim = by_image["python:3.13-slim-bookworm"]
    assert {"gcc", "libc6-dev", "make", "git", "curl", "wget", "procps"} <= slim.lacks
    assert not slim.extra and not slim.missing  # the stand-in is fixed, not excused
    assert by_image["python:3.13-bookworm"].has >= {"gcc", "libc6-dev", "git", "curl"}


def test_a_definition_installing_what_the_image_lacks_fails_the_file_check(tmp_path):
    images = tmp_path / "images"
    shutil.copytree(IMAGES, images)
    slim = images / "python-3.13-slim-bookworm.def"
    slim.write_text(slim.read_text().replace(
        "    apt-get clean\n", "    apt-get install -y --no-install-recommends gcc curl\n"
        "    apt-get clean\n", 1))
    found = check_file(load_expectations(), BaseTable.load(SHIPPED_TABLE, images_dir=images))
    assert found == [("python:3.13-slim-bookworm: debian-slim -> python-3.13-slim-bookworm "
                     "installs ['curl', 'gcc'], which the image lacks; remove them or list "
                     "them as deviations")]


def test_packages_held_by_name_follow_the_definition_in_order():
    from tmax.images.base_packages import named_packages

    text = ("Bootstrap: debootstrap\nInclude: bash git make\n%post\n"
            "    # apt-get install -y gcc (a comment installs nothing)\n"
            "    apt-get install -y --no-install-recommends gcc libc6-dev \\\n"
            "        wget=1.21 $saved\n"
            "    apt-get purge -y wget\n")
    assert named_packages(text) == {"bash", "git", "make", "gcc", "libc6-dev"}
    # the official images' idiom: all auto, the kept ones manual, then --auto-remove
    child = ("Bootstrap: localimage\nFrom: x\n%post\n    apt-get install -y curl\n"
             "    apt-mark auto '.*' > /dev/null\n    apt-mark manual bash curl tzdata\n"
             "    apt-get purge -y --auto-remove\n    apt-get install -y netbase\n")
    assert named_packages(child, {"bash", "git", "gcc"}) == {"bash", "curl", "netbase"}


def test_an_unmapped_or_remapped_entry_and_an_uncovered_base_are_named(tmp_path):
    table = tmp_path / "t.yaml"
    table.write_text(SHIPPED_TABLE.read_text().replace(
        '"ruby:3.3.*-slim*", base: ruby-3.3-slim', '"ruby:3.3.*-slim*", base: debian-trixie')
        .replace('  - {image: "ruby:3.3-slim*", base: ruby-3.3-slim}', "")
        + '  - {image: "corp/x:*", base: ubuntu-noble}\n')
    found = check_file(load_expectations(), BaseTable.load(table))
    assert any(f.startswith("ruby:3.3.5-slim: the table gives debian-trixie") for f in found)
    assert any(f.startswith("ruby:3.3-slim: no base in the table (no local base for image "
                            "'ruby:3.3-slim'") for f in found)
    (tmp_path / "images").mkdir()
    for p in IMAGES.glob("*.def"):
        shutil.copy(p, tmp_path / "images")
    shutil.copy(IMAGES / "ruby-3.3-slim.def", tmp_path / "images" / "ruby-new.def")
    table.write_text(SHIPPED_TABLE.read_text() + '  - {image: "ruby:4*", base: ruby-new}\n')
    found = check_file(load_expectations(), BaseTable.load(table, images_dir=tmp_path / "images"))
    assert found == ["base ruby-new: no image in packages.yaml says what it must hold"]


SLIM = Expectation(image="python:3.13-slim-bookworm", base="b", source="s",
                   has=frozenset({"ca-certificates", "tzdata"}),
                   lacks=frozenset({"gcc", "cpp", "libc6-dev", "git", "make"}),
                   extra=frozenset({"git"}), missing=frozenset(), why="w")


@pytest.mark.parametrize("installed, expected", [
    ({"ca-certificates", "tzdata", "git"}, []),
    # a stand-in once had gcc without its headers
    ({"ca-certificates", "tzdata", "git", "gcc", "cpp"},
     ["holds ['cpp', 'gcc'], which python:3.13-slim-bookworm lacks",
      ("holds gcc without libc6-dev: `apt-get install gcc` is then a no-op and compiling "
      "fails (stdio.h: No such file or directory)")]),
    ({"ca-certificates", "git", "make"},
     ["holds ['make'], which python:3.13-slim-bookworm lacks",
      "lacks ['tzdata'], which python:3.13-slim-bookworm holds"]),
    ({"ca-certificates", "tzdata"},  # a deviation fixed: the file must say so
     ["the deviations ['git'] listed for it no longer hold: remove them from packages.yaml"]),
])
def test_problems_name_each_mismatch(installed, expected):
    assert problems(SLIM, installed) == expected


def test_dpkg_status_counts_installed_packages_only():
    status = ("Package: gcc\nStatus: install ok installed\nDescription: x\n continued: y\n\n"
              "Package: libc6-dev\nStatus: deinstall ok config-files\n\n"
              "Package: curl\nStatus: install ok half-configured\n\n"
              "Package: git\nVersion: 1\nStatus: hold ok installed\n")
    assert dpkg_installed(status) == {"gcc", "git"}


@pytest.mark.parametrize("text, match", [
    ("watched: [gcc]\nimages:\n  - {image: a, base: b, source: s, has: [gcc], colour: x}\n",
     r"images\[0\]: needs image, base, source, has"),
    ("watched: [gcc]\nimages:\n  - {image: a, base: b, source: s, has: [curl]}\n",
     r"images\[0\] \(a\): 'has' names \['curl'\], which are not in 'watched'"),
    (("watched: [gcc]\nimages:\n  - {image: a, base: b, source: s, has: [],"
     " deviations: {extra: [gcc]}}\n"), r"'deviations' holds extra, missing and why"),
    (("watched: [gcc]\nimages:\n  - {image: a, base: b, source: s, has: [gcc],"
     " deviations: {extra: [gcc], why: w}}\n"), r"\['gcc'\]: a package is either held"),
    ("images: []\n", "needs exactly 'watched' and 'images'"),
])
def test_a_bad_packages_file_names_the_entry(tmp_path, text, match):
    path = tmp_path / "packages.yaml"
    path.write_text(text)
    with pytest.raises(PackagesFileError, match=match):
        load_expectations(path)


# --------------------------------------------------------------------------- real builds

FIXED = ("python-3.13-slim-bookworm", "ruby-3.3-slim")


@pytest.fixture(scope="module")
def fixed_bases(base_store):
    """The store of the slim Debian base with the bases this check fixed built into it
    (cached there between sessions: a CPython build the first time, minutes)."""
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder

    builds = ImageBuilds(base_store, LocalBuilder(Path.home() / ".cache" / "tmax"))
    return {name: builds.ensure_base(name) for name in FIXED}


@pytest.mark.slow
@pytest.mark.sandbox
def test_the_fixed_bases_hold_what_their_images_hold(base_store, fixed_bases):
    expectations = [e for e in load_expectations(PACKAGES_FILE) if e.base in FIXED]
    assert {e.base for e in expectations} == set(FIXED)
    for e in expectations:
        installed = sif_installed(base_store.path(fixed_bases[e.base].sif))
        assert problems(e, installed) == [], e.image
    slim = sif_installed(base_store.path(fixed_bases["python-3.13-slim-bookworm"].sif))
    assert not {"gcc", "cpp", "make", "git", "curl", "wget", "procps", "perl", "python3"} & slim


@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.parametrize("name, dockerfile", [
    # gcc was once there without libc6-dev, so apt's no-op left no stdio.h
    ("gcc-over-slim", ("FROM python:3.13-slim-bookworm\nRUN apt-get update && "
     "apt-get install -y gcc && printf '#include <stdio.h>\\nint main(){puts(\"ok\");}' "
     "> /t.c && gcc /t.c -o /t && /t\nWORKDIR /app\n")),
    ("ruby-slim", "FROM docker.io/library/ruby:3.3.5-slim@sha256:" + "5e" * 32 + "\n"
     "RUN test \"$(ruby -e 'puts 1+1')\" = 2 && gem --version && bundle --version\n"
     "RUN ruby -e 'puts 1+1' > /two.txt\nWORKDIR /app\n"),
    ("ruby-slim-mirror", ("FROM some.mirror/library/ruby:3.3-slim\n"
     "RUN ruby -e 'require \"json\"; puts JSON.generate([1+1])' > /two.txt\nWORKDIR /app\n")),
])
def test_dockerfiles_the_real_images_build_build_over_the_stand_ins(
        tmp_path, base_store, fixed_bases, name, dockerfile):
    from sandfleet import layers
    from tests.conftest import link_base, store_with_base
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder
    from tmax.tasks import load_task

    store = store_with_base(tmp_path / "store", base_store)
    link_base(store, base_store, "debian-trixie")
    for base in FIXED:
        link_base(store, base_store, base)
    task = load_task(make_task(tmp_path / "tasks", name,
                               **{"environment/Dockerfile": dockerfile}))
    builds = ImageBuilds(store, LocalBuilder(Path.home() / ".cache" / "tmax"))
    result = builds.build(task, check=False)
    log = Path(result.log).read_text() if result.log and Path(result.log).is_file() else ""
    assert result.status == "built", f"{result.error}\n{log[-3000:]}"
    if name.startswith("ruby"):
        two = layers.cat(store.path(store.read().tasks[task.task_id].sif), "two.txt")
        assert (two or "").strip() in ("2", "[2]")
