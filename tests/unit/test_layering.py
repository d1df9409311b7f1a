"""Layered images: a root split into a layer over its base, and read back merged.

Hand-made roots (as root: ownership and devices are part of what a layer must keep); the
layer is packed with mksquashfs and merged back with ``layers.flatten`` (unsquashfs), so a
wrong diff, a lost whiteout or lost attributes show as a merged tree unlike the image's.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from sandfleet import layers, sif
from tmax.images import layering

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mksquashfs"),
                                reason="needs root and squashfs-tools")


def write(path: Path, text: str, mode: int = 0o644, mtime: int = 1_700_000_000) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    os.utime(path, (mtime, mtime))


@pytest.fixture
def roots(tmp_path):
    base, image = tmp_path / "base", tmp_path / "image"
    write(base / "etc/motd", "welcome\n")
    write(base / "etc/old name", "a name with a blank\n")
    write(base / "etc/same", "unchanged\n")
    write(base / "etc/edited", "aaaa\n")           # same size and mtime after the edit
    write(base / "etc/mode", "x\n")
    write(base / "etc/owner", "x\n")
    write(base / "usr/share/doc/a/README", "doc\n")
    write(base / "var/lib/apt/lists/big", "lists\n")
    write(base / "opt/thing", "a file, then a folder\n")
    os.symlink("same", base / "etc/link")
    (base / "empty-dir").mkdir()
    shutil.copytree(base, image, symlinks=True)
    os.unlink(image / "etc/motd")                                  # removed file
    os.unlink(image / "etc/old name")                              # (a blank in its name)
    write(image / "etc/edited", "bbbb\n")                           # content only
    (image / "etc/mode").chmod(0o600)                              # mode only
    os.chown(image / "etc/owner", 1234, 1234)                      # owner only
    shutil.rmtree(image / "usr/share/doc/a")                       # removed folder
    os.unlink(image / "opt/thing")
    write(image / "opt/thing/inside", "now a folder\n")             # file -> folder
    os.unlink(image / "etc/link")
    os.symlink("edited", image / "etc/link")                       # link retargeted
    write(image / "app/new.txt", "new\n", mode=0o755)               # added
    write(image / ".tmax/verifier/bin/uv", "#!/bin/sh\n", mode=0o755)  # the tools' layer
    write(image / ".tmax/verifier/unmet", "tests/test.sh:3: apt-get install gcc\n")  # own
    return base, image


def test_the_diff_lists_exactly_what_the_task_changed(roots):
    base, image = roots
    d = layering.diff(image, base)
    assert sorted(d.whiteouts) == ["etc/motd", "etc/old name", "usr/share/doc/a"]
    assert set(d.entries) == {
        ".tmax", ".tmax/verifier", ".tmax/verifier/bin", ".tmax/verifier/bin/uv",
        ".tmax/verifier/unmet",
        "app", "app/new.txt", "etc", "etc/edited", "etc/mode", "etc/owner", "etc/link",
        "opt", "opt/thing", "opt/thing/inside", "usr", "usr/share", "usr/share/doc"}
    assert d.entries.index("opt") < d.entries.index("opt/thing") < \
        d.entries.index("opt/thing/inside")  # parents first


def test_an_unchanged_root_has_an_empty_diff(roots):
    base, _ = roots
    copy = base.parent / "copy"
    shutil.copytree(base, copy, symlinks=True)
    assert layering.diff(copy, base) == layering.Diff()


def tree(root: Path) -> dict[str, tuple]:
    """Each entry's type, mode, owner and content (file text, link target)."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        what = path.read_text() if stat.S_ISREG(st.st_mode) else \
            os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
        out[path.relative_to(root).as_posix()] = (stat.S_IFMT(st.st_mode),
                                                   stat.S_IMODE(st.st_mode),
                                                   st.st_uid, st.st_gid, what)
    return out


def test_layers_over_the_base_merge_back_into_the_image(roots, tmp_path):
    base, image = roots
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    task, tools = layering.split(image, base, work, out, timeout=120)
    assert (task.name, tools.name) == ("task.sqfs", "tools.sqfs")
    listing = subprocess.run(["unsquashfs", "-lls", "-n", "-d", "", str(task)],
                             capture_output=True, text=True, check=True).stdout
    assert "/etc/same" not in listing and "/.tmax/verifier/bin" not in listing  # own only
    assert "/.tmax/verifier/unmet" in listing  # what this task's build could not prepare
    tools_listing = subprocess.run(["unsquashfs", "-lls", "-n", "-d", "", str(tools)],
                                   capture_output=True, text=True, check=True).stdout
    assert "/.tmax/verifier/bin/uv" in tools_listing and "unmet" not in tools_listing
    assert layers.whiteouts(layers.Layer(task, 0, task.stat().st_size)) == \
        ["etc/motd", "etc/old name", "usr/share/doc/a"]
    base_sqfs = tmp_path / "base.sqfs"
    layering.pack_layer(base, [], base_sqfs, timeout=120)
    image_file = tmp_path / "task.layers"
    layers.write(image_file, [task, tools, base_sqfs])
    merged = layers.flatten(image_file, tmp_path / "merged.sqfs")
    subprocess.run(["unsquashfs", "-n", "-q", "-d", str(tmp_path / "m"), str(merged)],
                   check=True, capture_output=True)
    assert tree(tmp_path / "m") == tree(image)
    assert layers.cat(image_file, "etc/edited") == "bbbb\n"     # the task's layer
    assert layers.cat(image_file, "etc/same") == "unchanged\n"  # the base's
    assert layers.cat(image_file, "etc/motd") is None          # removed by the task


def test_equal_layers_are_equal_files(roots, tmp_path):
    """Packing is reproducible: two builds of the same change are one file in a store."""
    base, image = roots
    sums = []
    for i in range(2):
        work, out = tmp_path / f"w{i}", tmp_path / f"o{i}"
        work.mkdir()
        out.mkdir()
        layering.split(image, base, work, out, timeout=120)
        sums.append([sif_bytes(out / n) for n in ("task.sqfs", "tools.sqfs")])
    assert sums[0] == sums[1]


def test_owners_reads_modes_and_ids_as_the_squashfs_records_them(roots, tmp_path):
    _, image = roots
    out = tmp_path / "image.sqfs"
    (image / "app/new.txt").chmod(0o4751)
    layering.pack_layer(image, [], out, timeout=120)
    found = layering.owners(out)
    assert found["app/new.txt"] == (stat.S_IFREG | 0o4751, 0, 0)
    assert found["etc/owner"] == (stat.S_IFREG | 0o644, 1234, 1234)
    assert found["etc/link"][0] == stat.S_IFLNK | 0o777
    assert stat.S_ISDIR(found[""][0]) and stat.S_ISDIR(found["opt/thing"][0])


def sif_bytes(path: Path) -> bytes:
    return path.read_bytes()


def test_a_bad_layers_file_names_the_file_and_the_fault(tmp_path, roots):
    base, _ = roots
    good = tmp_path / "l.sqfs"
    layering.pack_layer(base, [], good, timeout=120)
    cases = {
        "missing.layers": None,
        "json.layers": "{not json",
        "keys.layers": json.dumps({"layers": ["l.sqfs"]}),
        "empty.layers": json.dumps({"sandfleet_layers": 1, "layers": []}),
        "absent.layers": json.dumps({"sandfleet_layers": 1, "layers": ["nope.sqfs"]}),
        "notsquash.layers": json.dumps({"sandfleet_layers": 1, "layers": ["junk"]}),
    }
    (tmp_path / "junk").write_bytes(b"\0" * 4096)
    for name, text in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(sif.SifError) as e:
            layers.read(tmp_path / name)
        assert e.value.path == tmp_path / name, name
    with pytest.raises(sif.SifError, match="layer nope.sqfs: no such file"):
        layers.read(tmp_path / "absent.layers")
    with pytest.raises(ValueError, match=r"\.layers"):
        layers.write(tmp_path / "x.json", [good])


def test_only_the_base_may_be_a_sif(tmp_path, roots):
    base, _ = roots
    a_sif = sif.pack(base, tmp_path / "b.sif")
    layer = tmp_path / "l.sqfs"
    layering.pack_layer(base, [], layer, timeout=120)
    layers.write(tmp_path / "ok.layers", [layer, a_sif])
    assert [la.offset > 0 for la in layers.read(tmp_path / "ok.layers")] == [False, True]
    assert layers.apptainer_args(tmp_path / "ok.layers") == \
        ["--overlay", f"{layer}:ro", str(a_sif)]
    with pytest.raises(sif.SifError, match="only the base"):
        layers.write(tmp_path / "bad.layers", [a_sif, layer])


def test_the_tools_key_leaves_out_where_lines_sit_and_other_programs(tmp_path):
    a = "tmax_failed offline 'tests/test.sh:21: curl ... | sh'\nuvx -p 3.13 pytest\n"
    b = "tmax_failed offline 'tests/test.sh:18: curl ... | sh'\nuvx -p 3.13 pytest\n"
    c = "tmax_failed offline 'tests/test.sh:18: curl ... | sh'\nuvx -p 3.12 pytest\n"
    assert layering.tools_key_text(a) == layering.tools_key_text(b) != \
        layering.tools_key_text(c)
    (tmp_path / "usr/bin").mkdir(parents=True)
    for name in ("python3.11", "python3-config", "python3.11-config", "pythonista"):
        (tmp_path / "usr/bin" / name).write_text("x")
    os.symlink("python3.11", tmp_path / "usr/bin/python3")
    assert layering.pythons(tmp_path, "/usr/local/bin:/usr/bin") == \
        [("/usr/bin/python3", 1), ("/usr/bin/python3.11", 1)]
