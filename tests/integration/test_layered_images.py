"""Layered task images end to end: sandboxes of a layers file on both runtimes, and a
store of layered builds (shared base, own layers, gc, single-file entries beside them)."""



from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES, LAYER_MARK, checked_local_builds
from tests.seal_helpers import (  # noqa: F401  (fixtures)
    on_both_runtimes,
    run,
    sealed_make,
    sealed_runtime,
    verify,
)


@on_both_runtimes()
def test_a_sandbox_of_a_layered_image_sees_the_layers_and_not_what_they_remove(make, runtime,
                                                                              tmp_path):
    a = make()
    out = run(runtime, a, ["sh", "-c", (f"cat {LAYER_MARK} /etc/issue; ls /etc/motd; "
                                       "test -x /usr/bin/which && echo base-kept")]).output
    assert "layered\nTMax layered test image\n" in out
    assert "No such file" in out and "base-kept" in out
    # writes over a layer's file and the base's go to the sandbox's own layer only
    assert run(runtime, a, ["sh", "-c", (f"echo mine > {LAYER_MARK} && echo x > /etc/motd && "
                                        "rm /usr/bin/which")]).exit_code == 0
    b = make()
    out_b = run(runtime, b, ["sh", "-c", f"cat {LAYER_MARK}; ls /etc/motd /usr/bin/which"])
    assert "layered\n" in out_b.output and "/usr/bin/which" in out_b.output
    assert "No such file or directory" in out_b.output  # /etc/motd: still removed for b
    # the verifier grades a's files over the layered image: the agent's /etc, the image's
    # /usr as built (the base's /usr/bin/which, which the agent removed), the task layer's
    # /etc/issue
    result, reward = verify(runtime, a, tmp_path,
                            f'r=0; [ "$(cat {LAYER_MARK})" = mine ] && [ -f /etc/motd ] && '
                            '[ -x /usr/bin/which ] && grep -q layered /etc/issue && r=1; '
                            'echo $r > /logs/verifier/reward.txt')
    assert (result.exit_code, reward) == (0, "1"), result.output


@pytest.fixture(scope="module")
def with_tools(layered_base, tmp_path_factory) -> Path:
    """``layered_base`` with a verifier tools layer between its task layer and the base,
    as builds store a task whose verifier needs tools: /.tmax/verifier/bin/mark."""
    from sandfleet import layers
    from tmax.images import layering

    root = tmp_path_factory.mktemp("with-tools")
    tool = root / "tree" / ".tmax" / "verifier" / "bin" / "mark"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\necho 1\n")
    tool.chmod(0o755)
    for folder in (root / "tree", *list((root / "tree").rglob("*"))):
        if folder.is_dir():
            folder.chmod(0o755)
    layering.pack_layer(root / "tree", [], root / "tools.sqfs", timeout=120)
    task, base = layers.read(layered_base)[0].path, layers.read(layered_base)[-1].path
    layers.write(root / "image.layers", [task, root / "tools.sqfs", base])
    return root / "image.layers"


@pytest.fixture(scope="module")
def one_file_with_tools(with_tools, tmp_path_factory) -> Path:
    """``with_tools`` merged into one squashfs, a one-layer image: the tools in the image's
    own root, as a single-file task image has them."""
    from sandfleet import layers

    root = tmp_path_factory.mktemp("one-file")
    layers.write(root / "image.layers", [layers.flatten(with_tools, root / "merged.sqfs")])
    return root / "image.layers"


@on_both_runtimes()
@pytest.mark.parametrize("kind", ["layered", "one file"])
def test_the_tools_layer_is_the_verifiers_alone(make, runtime, tmp_path, with_tools,
                                               one_file_with_tools, kind):
    """(On Apptainer the tools of a single-file image were not hidden either: its overlay's
    whiteout was made in the wrong folder.)"""
    a = make(image=with_tools if kind == "layered" else one_file_with_tools)
    peek = f"ls -A /.tmax/verifier; cat /.tmax/verifier/bin/mark; cat {LAYER_MARK}"
    seen = run(runtime, a, ["sh", "-c", peek])
    assert "echo 1" not in seen.output and "layered" in seen.output  # hidden, layers there
    result, reward = verify(runtime, a, tmp_path,
                            "/.tmax/verifier/bin/mark > /logs/verifier/reward.txt")
    assert (result.exit_code, reward) == (0, "1"), result.output


@pytest.mark.parametrize("runtime_kind", ["local"], scope="module")
def test_a_layers_file_that_cannot_be_used_is_an_image_missing_naming_it(runtime, tmp_path,
                                                                        base_sif):
    from sandfleet import ImageMissing, SandboxSpec

    bad = tmp_path / "task.layers"
    bad.write_text(json.dumps({"sandfleet_layers": 1, "layers": ["gone.sqfs",
                                                                  str(base_sif)]}))
    with pytest.raises(ImageMissing, match=r"task\.layers.*layer gone\.sqfs: no such file"):
        runtime.start("bad-layers", SandboxSpec(image=bad))


@pytest.mark.slow
def test_a_store_of_layered_images(tmp_path, base_store):
    """Two example tasks built layered (with their checks: oracle 1, nop 0 on the layered
    image) and one single-file, in one store: the base stored once, each task's own bytes
    a few KB, verify clean, gc of a dropped task removes its layer only."""
    from tests.conftest import store_with_base
    from tmax.images.store import own_bytes
    from tmax.tasks.native import load_task

    store = store_with_base(tmp_path / "store", base_store)
    builds = checked_local_builds(store)
    tasks = {name: load_task(EXAMPLES / name) for name in
             ("hello-world-file", "sha256-digest", "count-log-lines")}
    for name in ("hello-world-file", "sha256-digest"):
        result = builds.build(tasks[name])
        assert result.status == "built", result.error
        assert (result.checks["nop_reward"], result.checks["oracle_reward"]) == (0.0, 1.0)
    builds.layered = False
    assert builds.build(tasks["count-log-lines"], check=False).status == "built"
    manifest = store.read()
    layered = manifest.tasks["hello-world-file"]
    assert layered.sif.endswith(".layers") and len(layered.layers) == 1
    assert manifest.tasks["count-log-lines"].sif.endswith(".sif")
    own = own_bytes(manifest)
    assert own["hello-world-file"] < 256 * 1024 and own["sha256-digest"] < 256 * 1024
    assert own["count-log-lines"] > 50 * 2**20  # a whole root
    assert store.verify() == []
    from click.testing import CliRunner

    from tmax.images.cli import images_group

    listing = CliRunner().invoke(images_group, ["ls", "--store", str(store.root)]).output
    assert "hello-world-file" in listing and "1 layers" in listing and "one SIF" in listing
    for task_id, entry in manifest.tasks.items():
        assert store.task_image(task_id, entry.digest) == entry
    gone = store.path(manifest.tasks["sha256-digest"].layers[0].path)
    kept = store.path(layered.layers[0].path)
    removed = store.gc(keep_tasks={"hello-world-file", "count-log-lines"})
    assert gone in removed and not gone.exists() and kept.exists()
    assert store.path(manifest.bases["debian-slim"].sif).exists()


def test_a_corrupt_layer_is_named_by_verify(tmp_path, base_store, layered_base):
    from tests.conftest import store_with_base
    from tmax.images.store import ImageEntry, LayerFile, file_sha256

    store = store_with_base(tmp_path / "store", base_store)
    layer = store.path("layers/x.sqfs")
    shutil.copyfile(Path(layered_base).parent / "task.sqfs", layer)
    base = store.read().bases["debian-slim"]
    from sandfleet import layers

    layers.write(store.path("sif/d.layers"), [layer, store.path(base.sif)])
    ref = LayerFile(path="layers/x.sqfs", size=layer.stat().st_size,
                    sha256=file_sha256(layer))
    entry = ImageEntry(task_id="t", digest="d", sif="sif/d.layers",
                       size=store.path("sif/d.layers").stat().st_size,
                       sha256=file_sha256(store.path("sif/d.layers")), base="debian-slim",
                       base_digest=base.digest, builder="local", log="", built_at="",
                       build_seconds=0, layers=[ref])
    store.update(lambda m: m.tasks.__setitem__("t", entry))
    assert store.verify() == []
    layer.write_bytes(b"\0" * ref.size)
    problems = store.verify()
    reasons = {p["path"]: p["reason"] for p in problems if p["image"] == "task t"}
    assert set(reasons) == {str(layer), str(store.path("sif/d.layers"))}  # and its user
    assert "not a squashfs layer" in reasons[str(layer)]
    assert "layer ../layers/x.sqfs" in reasons[str(store.path("sif/d.layers"))]


SPLIT_AS_USER = """
import sys
from pathlib import Path
from tmax.images import layering
root = Path(sys.argv[1])
layers, _ = layering.split_sif(root / "image.sif", root / "base.sif", root / "user-cache",
                               root / "user-out", 120)
print(" ".join(p.name for p in layers))
"""


def test_an_ordinary_users_split_records_the_owners_roots_does(tmp_path, request):
    """A build as an ordinary user unpacks files as its own and cannot make devices: the
    layers take owners and modes from the SIFs' records instead, and come out as root's
    do (owners 1234 and 0, a setuid bit, a removal, a mode change)."""
    import pwd
    import stat

    from sandfleet import sif
    from tests.integration.test_apptainer_real import TEST_USER, as_user, user_python
    from tmax.images import layering

    try:
        entry = pwd.getpwnam(TEST_USER)
    except KeyError:  # (as tests/integration/test_apptainer_real.py makes it)
        subprocess.run(["useradd", "--system", "--home-dir", f"/tmp/{TEST_USER}",
                        "--create-home", "--shell", "/usr/sbin/nologin", TEST_USER],
                       check=True, timeout=60, capture_output=True)
        entry = pwd.getpwnam(TEST_USER)
    root = Path(tempfile.mkdtemp(prefix="tmax-layers-", dir="/tmp"))  # the user reads it
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    base, image = root / "base-root", root / "image-root"
    for tree in (base, image):
        (tree / "etc").mkdir(parents=True)
        (tree / "etc" / "motd").write_text("hi\n")
        (tree / "etc" / "keep").write_text("keep\n")
    (image / "etc" / "motd").unlink()
    (image / "etc" / "keep").chmod(0o600)
    (image / "srv").mkdir()
    (image / "srv" / "tool").write_text("#!/bin/sh\n")
    (image / "srv" / "tool").chmod(0o4755)
    os.chown(image / "srv", 1234, 1234)
    sif.pack(base, root / "base.sif")
    sif.pack(image, root / "image.sif")
    root.chmod(0o755)
    for sub in ("user-cache", "user-out"):
        (root / sub).mkdir()
        os.chown(root / sub, entry.pw_uid, entry.pw_gid)
    python, env = user_python()
    done = as_user(entry, [python, "-c", SPLIT_AS_USER, str(root)], timeout=300,
                   extra_env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["task.sqfs"]
    (root / "root-out").mkdir()
    mine, _ = layering.split_sif(root / "image.sif", root / "base.sif", tmp_path / "cache",
                                 root / "root-out", 120)
    theirs = layering.owners(root / "user-out" / "task.sqfs")
    assert theirs == layering.owners(mine[0])
    assert theirs["srv"][1:] == (1234, 1234) and theirs["srv/tool"][0] & stat.S_ISUID
    assert theirs["etc/keep"][0] & 0o777 == 0o600 and stat.S_ISCHR(theirs["etc/motd"][0])
