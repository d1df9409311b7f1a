"""The image's tools on the verifier's PATH outside /usr (a venv in /opt, /go/bin), attacked
by the agent's root, on the local and the apptainer runtime (issues 11, 32 and 33): the
image's copy of each folder the verifier's PATH names outside /usr and the work, never the
agent's (its programs, its library code, links in their place), and the agent's work where
the PATH names it. An attack the apptainer runtime (as root) does not stop is a strict
expected failure there, naming the guarantee it lacks (tests/seal_helpers.py).
"""

# ruff: noqa: F811  (the fixtures imported from tests.seal_helpers are parameters here)
from __future__ import annotations

import pytest

from tests.seal_helpers import (  # noqa: F401  (fixtures)
    FORGE_SH,
    LINKS_FOLLOWED,
    READ_ONLY_PATH_FOLDERS,
    RUNNER_SH,
    VENV_PATH,
    kind,
    on_both_runtimes,
    run,
    sealed_make,
    sealed_runtime,
    venv_sif,
    verify,
    write_file,
)

pytestmark = pytest.mark.sandbox


@on_both_runtimes()
@pytest.mark.parametrize("attack", [
    "cp /var/forge /opt/tool/bin/runner",
    "cp /var/forge /opt/tool/lib/grade.sh",  # the venv's library code, run by its program
    # the whole folder, and the folder holding it, replaced by links to the agent's copies
    ("cp -a /opt/tool /root/tool && cp /var/forge /root/tool/bin/runner && rm -rf /opt/tool"
     " && ln -s /root/tool /opt/tool"),
    ("cp -a /opt /root/opt && cp /var/forge /root/opt/tool/bin/runner && rm -rf /opt"
     " && ln -s /root/opt /opt"),
    ("rm -rf /opt/tool/bin && mkdir /root/bin && cp /var/forge /root/bin/runner"
     " && ln -s /root/bin /opt/tool/bin"),
], ids=["program", "library", "folder-linked", "parent-linked", "bin-linked"])
def test_the_verifier_runs_the_images_tools_on_its_path_outside_usr(attack, runtime, make,
                                                                     venv_sif, tmp_path):
    """The hole found on a real Terminal-Bench task: the image's ENV PATH starts with a venv
    in /opt, test.sh runs its pytest, and an agent that replaces that pytest (or the
    library code it runs, or the venv by a link to its own copy) with a script writing
    reward 1 scored 1. The verifier gets the image's copy of every folder its PATH names
    outside /usr (here /opt/tool, whole), so the image's runner writes its 0.25; the
    agent's own files are still there for the agent, set aside where they were links."""
    sid = make(image=venv_sif)
    forge = write_file("/var/forge", FORGE_SH, "755")
    check = ("rm -f /logs/verifier/reward.txt; /opt/tool/bin/runner 2>/dev/null; "
             "cat /logs/verifier/reward.txt 2>/dev/null; ls -a / /opt")
    assert run(runtime, sid, f"{forge} && {attack} && {check}").output.startswith("1\n")
    result, reward = verify(runtime, sid, tmp_path, RUNNER_SH, env={"PATH": VENV_PATH})
    assert (result.exit_code, reward) == (0, "0.25"), result.output
    # the agent keeps its files; on the local runtime a link where the image has a folder on
    # the way to a mount point (/opt, /opt/tool) is renamed beside it, and its target is
    # untouched; on Apptainer the verifier's binds never touched the agent's files
    after = run(runtime, sid, check + "; ls /root/tool/bin /root/opt/tool/bin").output.split()
    aside = [n.rsplit("-", 1)[0] for n in after if n.startswith(".tmax-set-aside-")]
    if kind(runtime) == "local" and attack.endswith(("/opt/tool", "/opt")):
        assert aside == [f".tmax-set-aside-{attack.rsplit('/', 1)[1]}"], after
        assert "runner" in after, after
    else:
        assert (after[0], aside) == ("1", []), after


@on_both_runtimes(apptainer_lacks=LINKS_FOLLOWED)
def test_the_verifier_view_never_follows_an_agents_link_on_the_host(runtime, make, venv_sif,
                                                                    tmp_path):
    """/opt replaced by a link to an absolute path that exists on the host, not inside:
    the host makes the mount points (/opt, /opt/tool) real directories of the agent's tree
    one component at a time, so it never creates or renames anything through that link
    (here: in a host folder, which stays empty)."""
    host = tmp_path / "host-side"
    host.mkdir()
    sid = make(image=venv_sif)
    run(runtime, sid, f"rm -rf /opt && ln -s {host} /opt")
    result, reward = verify(runtime, sid, tmp_path, RUNNER_SH, env={"PATH": VENV_PATH})
    assert list(host.iterdir()) == []
    assert (result.exit_code, reward) == (0, "0.25"), result.output


@on_both_runtimes()
def test_the_workdir_and_top_level_folders_on_the_verifiers_path_stay_the_agents(
        runtime, make, venv_sif, tmp_path):
    """A PATH entry in a top-level folder (/app/bin: /app) or the workdir's (/srv/work/bin:
    /srv/work) names the agent's work, not a tool: the verifier sees the agent's version,
    while /opt/tool/bin on the same PATH is still the image's; without a PATH in ``env``
    nothing beyond /usr is the image's (the default PATH is all in it)."""
    sid = make(image=venv_sif, workdir="/srv/work")
    tools = {"/app/bin/app-tool": "#!/bin/sh\necho agent-app\n",
             "/srv/work/bin/work-tool": "#!/bin/sh\necho agent-work\n",
             "/app/solve": "#!/bin/sh\necho agent-solve\n",
             "/var/forge": FORGE_SH}
    run(runtime, sid, " && ".join(write_file(p, t, "755") for p, t in tools.items())
        + " && cp /var/forge /opt/tool/bin/runner")
    test_sh = "pwd\napp-tool\nwork-tool\nsolve\n" + RUNNER_SH
    path = f"/app:/app/bin:/srv/work/bin:{VENV_PATH}"
    result, reward = verify(runtime, sid, tmp_path, test_sh, env={"PATH": path})
    assert result.output.split() == ["/srv/work", "agent-app", "agent-work", "agent-solve"], \
        result.output
    assert reward == "0.25", result.output
    # no PATH given: nothing is bound beyond the system folders
    result, reward = verify(runtime, sid, tmp_path, "/opt/tool/bin/runner\n", env={})
    assert reward == "1", result.output


@on_both_runtimes()
def test_agent_system_opt_in_keeps_the_agents_tools_on_its_path(runtime, make, venv_sif,
                                                                 tmp_path):
    sid = make(image=venv_sif)
    run(runtime, sid, write_file("/var/forge", FORGE_SH, "755")
        + " && cp /var/forge /opt/tool/bin/runner")
    env = {"PATH": VENV_PATH}
    assert verify(runtime, sid, tmp_path, RUNNER_SH, env=env)[1] == "0.25"
    assert verify(runtime, sid, tmp_path, RUNNER_SH, env=env, agent_system=True)[1] == "1"


@on_both_runtimes()
def test_a_program_the_agent_plants_first_on_the_verifiers_path_does_not_shadow_the_images(
        runtime, make, venv_sif, tmp_path):
    """A top-level folder first on the image's PATH (the golang images' /go/bin) or one the
    image has not (/root/.local/bin before anything is installed there) is the agent's; a
    `runner` it plants there would run instead of the image's /opt/tool/bin/runner. The
    verifier's PATH puts the agent's folders behind the image's, so the image's runs, and
    a tool only the agent has (agent-only) is still found."""
    sid = make(image=venv_sif)
    run(runtime, sid, write_file("/var/forge", FORGE_SH, "755")
        + " && mkdir -p /go/bin /root/.local/bin && cp /var/forge /go/bin/runner"
        + " && cp /var/forge /root/.local/bin/runner && "
        + write_file("/go/bin/agent-only", "#!/bin/sh\necho agent-only\n", "755"))
    test_sh = "agent-only\n" + RUNNER_SH
    env = {"PATH": f"/go/bin:/root/.local/bin:{VENV_PATH}"}
    result, reward = verify(runtime, sid, tmp_path, test_sh, env=env)
    assert (reward, result.output.split()[:1]) == ("0.25", ["agent-only"]), result.output
    assert verify(runtime, sid, tmp_path, test_sh, env=env, agent_system=True)[1] == "1"


@on_both_runtimes(apptainer_lacks=READ_ONLY_PATH_FOLDERS)
def test_the_verifier_writes_into_the_images_path_folders_on_a_layer_of_its_own(
        runtime, make, venv_sif, tmp_path):
    """The image's copy of a PATH folder is writable for the verifier (a `pip install` into
    the venv, cargo's lock in ~/.cargo), on a layer that goes with it: the agent's tree and
    the image keep what they had, and the agent's replacement stays out."""
    sid = make(image=venv_sif)
    run(runtime, sid, write_file("/var/forge", FORGE_SH, "755")
        + " && cp /var/forge /opt/tool/bin/runner")
    test_sh = ("echo verifier > /opt/tool/lib/added && cat /opt/tool/lib/added && "
               "echo 'echo 0.5 > /logs/verifier/reward.txt' > /opt/tool/lib/grade.sh && runner\n")
    result, reward = verify(runtime, sid, tmp_path, test_sh, env={"PATH": VENV_PATH})
    assert (result.exit_code, reward, result.output.split()[:1]) == (0, "0.5", ["verifier"]), \
        result.output
    after = run(runtime, sid, "ls /opt/tool/lib; cat /opt/tool/bin/runner").output
    assert "added" not in after and "echo 1" in after, after  # (FORGE_SH: the agent's)
    result, reward = verify(runtime, sid, tmp_path, RUNNER_SH, env={"PATH": VENV_PATH})
    assert reward == "0.25", result.output  # a fresh layer: the image's grade.sh again
