"""Dockerfiles read and built as Docker does: the parser (tmax.tasks.dockerfile), the build
script (tmax.images.plan), and one real build whose image shows Docker's order."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_images import cat_sif, list_sif
from tests.unit.test_tasks import make_task
from tmax.images.build import ImageBuilds
from tmax.images.builders import LocalBuilder
from tmax.images.plan import stage_script, step_error
from tmax.images.types import BuildError
from tmax.tasks import load_task
from tmax.tasks.dockerfile import (
    DEFAULT_PATH,
    ENTRYPOINT_SETTLE,
    Copy,
    DockerfileError,
    Run,
    Workdir,
    entrypoint_command,
    instructions,
    parse,
)

# --------------------------------------------------------------------------- lexing


def test_continuations_comments_and_the_escape_directive():
    text = ("# escape=`\n# a comment\nFROM debian:bookworm\nRUN echo a `\n# dropped\n"
            "    && echo b\n\nRUN echo \\\n")
    got = [(i.line, i.keyword, i.args) for i in instructions(text)]
    assert got == [(3, "FROM", "debian:bookworm"), (4, "RUN", "echo a     && echo b"),
                   (8, "RUN", "echo \\")]  # with ` as escape, a backslash is a character


def test_heredocs_attach_their_bodies():
    text = "FROM d\nRUN <<EOF\nset -e\necho hi\nEOF\nCOPY <<-END /etc/x\n\tindented\n\tEND\n"
    ins = instructions(text)
    assert [i.heredocs for i in ins[1:]] == [(("EOF", "set -e\necho hi\n"),),
                                             (("END", "indented\n"),)]
    with pytest.raises(DockerfileError, match="line 2: heredoc EOF is never closed"):
        instructions("FROM d\nRUN <<EOF\necho\n")


# --------------------------------------------------------------------------- variables


def test_env_substitution_as_docker_does_it():
    df = parse("FROM d\nENV A=1\nENV B=${A}x C=\"$A y\" D='$A' E=\\$A\n"
               "ENV F=${UNSET:-def} G=${A:+alt} H=${UNSET:+alt} I=${A:-no}\n"
               "ENV LEGACY two words $A\nENV PATH=/opt/bin:$PATH\n")
    env = df.final.env
    assert (env["A"], env["B"], env["C"], env["D"], env["E"]) == ("1", "1x", "1 y", "$A", "$A")
    assert (env["F"], env["G"], env["H"], env["I"]) == ("def", "alt", "", "1")
    assert env["LEGACY"] == "two words 1"
    assert env["PATH"] == f"/opt/bin:{DEFAULT_PATH}"


def test_args_global_in_from_and_per_stage():
    df = parse("ARG VERSION=3.12\nARG FLAVOR\nFROM python:${VERSION}-slim AS one\n"
               "ARG VERSION\nARG LOCAL=x${VERSION}\nENV E=$LOCAL\nRUN echo $LOCAL\n"
               "FROM debian:${FLAVOR:-bookworm}\nRUN echo $VERSION\n")
    one, two = df.stages
    assert (one.image, one.name, two.image) == ("python:3.12-slim", "one", "debian:bookworm")
    run = one.steps[0]
    assert isinstance(run, Run) and dict(run.env)["LOCAL"] == "x3.12" and \
        dict(run.env)["VERSION"] == "3.12"
    assert one.env["E"] == "x3.12" and "LOCAL" not in one.env  # ARGs are not the image's
    assert "VERSION" not in dict(two.steps[0].env)  # not declared in this stage
    assert "TARGETARCH" not in dict(run.env)  # automatic ARGs only where declared
    assert dict(parse("FROM d\nARG TARGETARCH\nRUN x\n").final.steps[0].env)["TARGETARCH"]


def test_env_wins_over_arg_and_each_step_sees_its_own_values():
    df = parse("FROM d\nARG X=arg\nRUN one\nENV X=env\nRUN two\nENV X=later\n")
    first, second = df.final.steps
    assert dict(first.env)["X"] == "arg" and dict(second.env)["X"] == "env"


# --------------------------------------------------------------------------- steps


def test_steps_keep_docker_order_paths_and_forms():
    df = parse("FROM --platform=linux/amd64 d@sha256:abc\nWORKDIR app\nCOPY a.txt b/ ./\n"
               "COPY [\"c d.txt\", \"rel\"]\nADD --chown=1:2 --chmod=600 e.tar /opt/\n"
               "WORKDIR sub\nRUN [\"python3\", \"-c\", \"print(1)\"]\n"
               "SHELL [\"/bin/bash\", \"-o\", \"pipefail\", \"-c\"]\nRUN --mount=type=cache,"
               "target=/x --network=none echo $HOME | cat\nUSER agent\nRUN id\nUSER root\n"
               "CMD [\"bash\"]\n")
    stage = df.final
    kinds = [type(s).__name__ for s in stage.steps]
    assert kinds == ["Workdir", "Copy", "Copy", "Copy", "Workdir", "Run", "Run", "Run"]
    w, c1, c2, add, w2, exec_run, shell_run, user_run = stage.steps
    assert isinstance(w, Workdir) and w.path == "/app" and w2.path == "/app/sub"
    assert (c1.sources, c1.dest, c1.into_dir) == (("a.txt", "b/"), "/app/", True)
    assert (c2.sources, c2.dest, c2.into_dir) == (("c d.txt",), "/app/rel", False)
    assert (add.add, add.chown, add.chmod, add.dest) == (True, "1:2", "600", "/opt/")
    assert exec_run.argv == ("python3", "-c", "print(1)")
    assert shell_run.argv == ("/bin/bash", "-o", "pipefail", "-c", "echo $HOME | cat")
    assert shell_run.network is False and shell_run.workdir == "/app/sub"
    assert user_run.user == "agent" and stage.user == ""
    assert stage.image == "d@sha256:abc"
    assert any("--platform=linux/amd64 ignored" in n for n in stage.notes)
    assert any("CMD ignored" in n for n in stage.notes)


def test_entrypoint_is_kept_and_started_as_harbor_starts_it():
    exec_form = parse('FROM d\nENTRYPOINT ["/entrypoint.sh", "--serve"]\nCMD ["bash"]\n').final
    assert exec_form.entrypoint == ("/entrypoint.sh", "--serve")
    assert any("ENTRYPOINT runs when a sandbox starts" in n for n in exec_form.notes)
    shell_form = parse('FROM d\nSHELL ["/bin/bash", "-c"]\nENTRYPOINT exec server "$PORT"\n')
    assert shell_form.final.entrypoint == ("/bin/bash", "-c", 'exec server "$PORT"')
    assert parse("FROM d\nENTRYPOINT [\"x\"]\nENTRYPOINT []\n").final.entrypoint == ()
    assert parse("FROM a AS b\nENTRYPOINT [\"x\"]\nFROM d\n").final.entrypoint == ()
    assert entrypoint_command(("/entrypoint.sh", "--serve"), "/srv app") == (
        "(cd '/srv app' && exec setsid /entrypoint.sh --serve sh -c 'sleep infinity') "
        f"</dev/null >/dev/null 2>&1 & {ENTRYPOINT_SETTLE}")
    assert entrypoint_command(()) == ""


def test_heredoc_run_and_copy():
    df = parse("FROM d\nRUN <<EOF\necho one\necho two\nEOF\nRUN cat > /f <<X\nbody\nX\n"
               "COPY <<EOF /etc/motd\nhello\nEOF\n")
    script_run, redirect_run, copy = df.final.steps
    assert script_run.argv == ("/bin/sh", "-c", "echo one\necho two\n")
    assert redirect_run.argv == ("/bin/sh", "-c", "cat > /f <<X\nbody\nX")
    assert isinstance(copy, Copy) and copy.inline == (("EOF", "hello\n"),) and \
        copy.sources == () and copy.dest == "/etc/motd"


def test_multi_stage_needs_only_what_the_final_stage_copies():
    df = parse("FROM a AS unused\nRUN x\nFROM b AS build\nRUN y\nFROM c\n"
               "COPY --from=build /out /app\nCOPY --from=ghcr.io/astral-sh/uv:0.8.14 /uv /bin/\n")
    assert [s.image for s in df.needed()] == ["b", "c"]
    from_stage, from_image = df.final.steps
    assert from_stage.from_stage == 1 and from_image.from_image == "ghcr.io/astral-sh/uv:0.8.14"
    assert df.copy_sources() == []  # neither reads the build context


def test_a_heredoc_with_blanks_after_the_arrows_is_read_as_buildkit_reads_it():
    # gordonyang-tbench's computer-resource-optimization-v2 and database-sharding: `RUN python3
    # << 'PY'`; BuildKit's lexer keeps the blanks after << in the word, so it is a heredoc
    text = ("FROM d\nRUN python3 << 'PY'\nimport json\nprint(json.dumps(1))\nPY\n"
            "RUN <<  EOF\necho alone\nEOF\nCOPY << \"END\" /etc/motd\nhello $HOME\nEND\n"
            "RUN echo $((1 << 2)) && cat <<<x && echo $((a << b))\n")
    ins = instructions(text)
    assert [i.heredocs for i in ins[1:]] == [
        (("PY", "import json\nprint(json.dumps(1))\n"),), (("EOF", "echo alone\n"),),
        (("END", "hello $HOME\n"),), ()]
    run_py, run_alone, copy, shifts = parse(text).final.steps
    assert run_py.argv == ("/bin/sh", "-c",
                           "python3 << 'PY'\nimport json\nprint(json.dumps(1))\nPY")
    assert run_alone.argv == ("/bin/sh", "-c", "echo alone\n")
    assert copy.inline == (("END", "hello $HOME\n"),) and copy.dest == "/etc/motd"
    assert shifts.argv[-1] == "echo $((1 << 2)) && cat <<<x && echo $((a << b))"


@pytest.mark.parametrize("text, message", [
    ("RUN x\n", "line 1: RUN before the first FROM"),
    ("FROM scratch\n", "line 1: FROM scratch is not supported"),
    ("FROM a\nFROBNICATE x\n", "line 2: unknown instruction FROBNICATE"),
    # BuildKit's lexer keeps blanks after << in the heredoc word, but not after <<-: there the
    # body's lines are instructions, in Docker as here
    ("FROM a\nRUN python3 <<- 'PY'\nimport json\nPY\n",
     ("line 3: unknown instruction IMPORT: line 2 opens a shell heredoc with a space after <<- "
     "(\"<<- 'PY'\")")),
    ("FROM a\nRUN cat <<-  EOF > /x\nfrom here to there\nEOF\n",
     "line 3: FROM 'here to there': expected 'image [AS name]': line 2 opens a shell heredoc"),
    ("FROM a\nADD https://github.com/x/y.git /src\n", "line 2: ADD of a git repository"),
    ("FROM a\nCOPY --parents a /b\n", "line 2: COPY --parents is not supported"),
    ("FROM a\nCOPY onlyone\n", "line 2: COPY needs a source and a destination"),
    ("FROM a\nENV A=\"open\n", "line 2: unterminated \" quote"),
    ("# just a comment\n", "no FROM line"),
])
def test_what_cannot_be_built_is_a_clear_error(text, message):
    with pytest.raises(DockerfileError, match=re.escape(message)):
        parse(text)


def test_script_runs_each_step_and_names_the_failing_line(tmp_path):
    """The build script on this machine's own shell: a failing command in the middle of an
    && chain stops the build at its line (the old joined ``sh -e`` script went on)."""
    df = parse("FROM d\nRUN echo first > out\nRUN false && echo never\nRUN echo after >> out\n")
    script = stage_script(df.final).replace("cd / &&", f"cd {tmp_path} &&")
    script = script.replace("rm -rf /.tmax-build", "")
    log = tmp_path / "log"
    with open(log, "w") as f:
        code = subprocess.run(["sh", "-c", script], stdout=f, stderr=subprocess.STDOUT,
                              check=False, timeout=30).returncode
    assert code == 1 and (tmp_path / "out").read_text() == "first\n"
    error = step_error(log, BuildError("build", "exit 1", log))
    assert error.what == "Dockerfile line 3: RUN false && echo never"
    assert error.reason.startswith("exit 1")


# --------------------------------------------------------------------------- a real build

FAITHFUL = """\
FROM debian:bookworm-slim
ARG GREETING=hello
ENV TOOL_HOME=/opt/tool APP=/app
WORKDIR $APP
COPY first.txt data.txt
RUN cp data.txt snapshot.txt && echo "$GREETING from $TOOL_HOME" > env.txt
COPY second.txt data.txt
RUN false && echo "never" ; echo "the status of the last command counts" > chain.txt
RUN useradd -m agent && mkdir -p /srv/shared && chown agent /srv/shared
USER agent
RUN id -un > /srv/shared/whoami && touch /srv/shared/by-agent
USER root
COPY --chown=agent:agent --chmod=640 tree/ /srv/tree/
ADD bundle.tar /opt/bundle/
SHELL ["/bin/bash", "-c"]
RUN [[ -n "$BASH_VERSION" ]] && echo bash > shell.txt
RUN <<EOF
echo "from a heredoc" > heredoc.txt
EOF
CMD ["sleep", "infinity"]
"""


def _build(tmp_path: Path, image_store, dockerfile: str, files: dict[str, str]):
    task = make_task(tmp_path, **{"environment/Dockerfile": dockerfile,
                                  **{f"environment/{k}": v for k, v in files.items()}})
    builds = ImageBuilds(image_store, LocalBuilder(Path.home() / ".cache" / "tmax"))
    result = builds.build(load_task(task), check=False)
    return result, image_store


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the local builder needs root")
def test_a_real_build_follows_docker_order(tmp_path, image_store):
    import tarfile

    bundle = tmp_path / "bundle-src"
    (bundle / "inner").mkdir(parents=True)
    (bundle / "inner" / "file").write_text("packed\n")
    env = tmp_path / "demo" / "environment"
    env.mkdir(parents=True)
    with tarfile.open(env / "bundle.tar", "w") as t:
        t.add(bundle / "inner", arcname="inner")
    result, store = _build(tmp_path, image_store, FAITHFUL, {
        "first.txt": "first\n", "second.txt": "second\n", "tree/a/b.txt": "deep\n"})
    assert result.status == "built", result.error
    sif = store.path(store.read().tasks["demo"].sif)

    def cat(path: str) -> str:
        out = tmp_path / f"cat-{path.replace('/', '_')}"
        out.mkdir()
        return cat_sif(sif, path, out)

    assert cat("/app/snapshot.txt") == "first\n"  # RUN saw the first COPY, not the second
    assert cat("/app/data.txt") == "second\n"
    assert cat("/app/env.txt") == "hello from /opt/tool\n"
    assert cat("/app/chain.txt").startswith("the status")
    assert cat("/srv/shared/whoami") == "agent\n"
    assert cat("/app/shell.txt") == "bash\n" and cat("/app/heredoc.txt") == "from a heredoc\n"
    assert cat("/opt/bundle/inner/file") == "packed\n"  # ADD unpacked the archive
    listing = list_sif(sif, "-lln")
    owners = {line.split()[-1]: (line.split()[0], line.split()[1]) for line in
              listing.splitlines() if line.startswith(("-", "d"))}
    assert owners["squashfs-root/srv/shared/by-agent"][1] == "1000/1000"  # USER agent wrote it
    assert owners["squashfs-root/srv/tree/a/b.txt"] == ("-rw-r-----", "1000/1000")
    assert owners["squashfs-root/app/data.txt"][1] == "0/0"
    assert ".tmax-build" not in list_sif(sif)  # the staging folder is gone
    env_file = cat("/.singularity.d/env/90-environment.sh")
    assert "TOOL_HOME=/opt/tool" in env_file and "GREETING" not in env_file
    assert "note: line 20: CMD ignored" in store.path(result.log).read_text()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the local builder needs root")
def test_a_failing_step_fails_the_build_with_its_line(tmp_path, image_store):
    result, _ = _build(tmp_path, image_store,
                       "FROM debian:bookworm-slim\nRUN echo ok\nRUN ls /nonexistent && echo x\n"
                       "RUN echo unreached\n", {})
    assert result.status == "failed"
    assert "Dockerfile line 3: RUN ls /nonexistent && echo x" in result.error
    assert "No such file or directory" in result.error  # the step's own output


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the local builder needs root")
def test_multi_stage_and_apt_in_the_local_builder(tmp_path, image_store):
    """apt works in the build chroot (its _apt sandbox needs setgroups), and the final stage
    gets only what it copies from the build stage."""
    result, store = _build(tmp_path, image_store, (
        "FROM debian:bookworm-slim AS build\nRUN apt-get update -qq && apt-get install -y -qq "
        "--no-install-recommends dos2unix && mkdir /out && printf 'a\\r\\n' | dos2unix > "
        "/out/converted && dos2unix --version | head -1 > /out/version\n"
        "FROM debian:bookworm-slim\nCOPY --from=build /out/ /app/\n"), {})
    assert result.status == "built", result.error
    sif = store.path(store.read().tasks["demo"].sif)
    out = tmp_path / "o"
    out.mkdir()
    assert cat_sif(sif, "/app/converted", out) == "a\n"
    assert "usr/bin/dos2unix" not in list_sif(sif)  # the build stage's packages stay there


def _user_base(tmp_path: Path, name: str, image: str, sections: str) -> Path:
    """A base of the user's (``name``.def over debian-slim with ``sections``) for images
    matching ``image``: the map file."""
    (tmp_path / f"{name}.def").write_text(
        f"Bootstrap: localimage\nFrom: debian-slim\n\n{sections}")
    user = tmp_path / "map.yaml"
    user.write_text(f"mappings:\n  - {{image: '{image}', base: {name}.def}}\n")
    return user


def _build_task(tmp_path: Path, image_store, task: Path, base_map: Path | None = None):
    """``task`` built by the local builder, unchecked: (its ImageBuilds, the result, its SIF,
    a folder for cat_sif)."""
    builds = ImageBuilds(image_store, LocalBuilder(Path.home() / ".cache" / "tmax"),
                         base_map=base_map)
    result = builds.build(load_task(task), check=False)
    assert result.status == "built", result.error
    out = tmp_path / "o"
    out.mkdir(exist_ok=True)
    return builds, result, image_store.path(image_store.read().tasks["demo"].sif), out


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the local builder needs root")
def test_stages_on_different_bases_each_start_from_their_own(tmp_path, image_store):
    """A builder stage over another base (tbench-multiturn's `FROM gcc:14 AS builder` then
    `FROM python:3.11-slim`): it runs over its own base, the final stage gets only what it
    copies; the image's digest covers that base too."""
    user = _user_base(tmp_path, "marked", "builder-test:*",
                      "%post\n    echo from-the-builder-base > /etc/builder-base\n")
    task = make_task(tmp_path, **{"environment/Dockerfile": (
        "FROM builder-test:1 AS builder\nRUN mkdir /out && cat /etc/builder-base > /out/seen\n"
        "FROM debian:bookworm-slim\nCOPY --from=builder /out/seen /app/seen\n")})
    builds, _, sif, out = _build_task(tmp_path, image_store, task, user)
    plan = builds.plan(load_task(task))
    assert (plan.base, plan.definition.stage_bases) == ("debian-slim", ("marked",))
    assert cat_sif(sif, "/app/seen", out) == "from-the-builder-base\n"
    assert "etc/builder-base" not in list_sif(sif)  # the final stage is over debian-slim
    (tmp_path / "marked.def").write_text((tmp_path / "marked.def").read_text() + "\n")
    assert builds.plan(load_task(task)).digest != plan.digest


def test_a_stage_from_an_earlier_stage_continues_it():
    """`FROM toolchain AS task` (a real Terminus task): the stage starts where `toolchain`
    ended, with its ENV, WORKDIR, USER and SHELL (ARGs do not carry over, as in Docker); the
    final stage needs it though nothing is copied from it; `FROM` a name that no stage has
    is an image."""
    text = ("ARG V=1\nFROM debian:bookworm AS toolchain\nARG V\nENV TOOLS=/opt/t\n"
            "WORKDIR /src\nSHELL [\"/bin/bash\", \"-c\"]\nUSER builder\nRUN make\n"
            "FROM debian:bookworm AS unused\nRUN true\n"
            "FROM Toolchain AS task\nRUN echo $TOOLS $V\nWORKDIR app\n")
    parsed = parse(text, workdir_of=lambda image: "/")
    toolchain, _, task = parsed.stages
    assert (task.parent, task.image) == (toolchain.index, "debian:bookworm")
    assert task.env["TOOLS"] == "/opt/t" and task.user == "builder"
    (run, workdir) = task.steps
    assert run.argv == ("/bin/bash", "-c", "echo $TOOLS $V")
    assert dict(run.env) == {"PATH": DEFAULT_PATH, "TOOLS": "/opt/t"}  # no V: ARGs reset
    assert (run.workdir, workdir.path) == ("/src", "/src/app")
    assert [s.name for s in parsed.needed()] == ["toolchain", "task"]
    assert any("FROM Toolchain continues stage toolchain" in n for n in task.notes)
    assert parse("FROM a AS b\nFROM c\n").final.parent is None


def test_apptainer_definition_of_a_stage_from_an_earlier_stage(tmp_path):
    """Apptainer cannot bootstrap from another stage: the final stage repeats the stage it
    continues (its files and script, whose staged files stay for the next script) before its
    own; that stage is not built on its own when nothing copies from it."""
    from tmax.images.plan import dockerfile_definition, dockerfile_over

    task = dockerfile_definition(
        "FROM debian:bookworm AS toolchain\nCOPY tool.c /src/\nRUN make /src/tool\n"
        "FROM toolchain AS task\nCOPY app /app\nRUN /src/tool /app\n",
        lambda image: "debian-slim")
    text = dockerfile_over(task, Path("/store/bases/b.sif"), tmp_path)
    (final,) = text.split("Bootstrap: localimage")[1:]
    assert final.startswith("\nFrom: /store/bases/b.sif\nStage: s1\n")
    assert (f"%files\n    {tmp_path}/s0/.tmax-build /\n    {tmp_path}/s1/.tmax-build /\n"
            in final)
    post = final[final.index("%post"):]
    assert post.index("make /src/tool") < post.index("/src/tool /app")
    assert post.count("rm -rf /.tmax-build") == 1 and \
        post.rindex("rm -rf /.tmax-build") > post.index("/src/tool /app")
    assert "%environment" in final


def test_apptainer_definition_of_a_multi_stage_build(tmp_path):
    """What `apptainer build` gets for two stages: each bootstrapped from the base with its
    own Stage name, the final one copying from the first by ``%files from s0`` into the
    staging folder its script copies from, the final ENV as %environment."""
    from tmax.images.plan import dockerfile_definition, dockerfile_over

    task = dockerfile_definition(
        "FROM debian:bookworm AS build\nRUN make /out/tool\n"
        "FROM debian:bookworm\nENV MODE=prod\nCOPY --from=build /out/tool /usr/local/bin/\n",
        lambda image: "debian-slim")
    text = dockerfile_over(task, Path("/store/bases/b.sif"), tmp_path)
    first, final = text.split("Bootstrap: localimage")[1:]
    assert first.startswith("\nFrom: /store/bases/b.sif\nStage: s0\n")
    assert final.startswith("\nFrom: /store/bases/b.sif\nStage: s1\n")
    assert "%files from s0\n    /out/tool /.tmax-build/s1/c5/f0/tool\n" in final
    assert f"%files\n    {tmp_path}/s1/.tmax-build /\n" in final
    assert "tmax_copy /.tmax-build/s1/c5 /usr/local/bin/ 1" in final
    assert "%environment\n    export PATH=" in final and "export MODE=prod" in final
    assert "%environment" not in first and "make /out/tool" in first


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the local builder needs root")
def test_a_stage_from_an_earlier_stage_is_built_over_its_result(tmp_path, image_store):
    """claims-remittance-auth-desk's `FROM toolchain AS task`: the local builder builds the
    final stage over what `toolchain` left (files, ENV), then its own steps."""
    task = make_task(tmp_path, **{"environment/Dockerfile": (
        "FROM debian:bookworm-slim AS toolchain\nENV TOOL_HOME=/opt/tool\n"
        "COPY tool.sh /opt/tool/\nRUN chmod +x /opt/tool/tool.sh && echo built > /opt/tool/mark\n"
        "FROM toolchain AS task\nRUN $TOOL_HOME/tool.sh > /app/out && cat /opt/tool/mark >> /app/out\n"),
        "environment/tool.sh": "#!/bin/sh\necho from-the-tool\n"})
    _, _, sif, out = _build_task(tmp_path, image_store, task)
    assert cat_sif(sif, "/app/out", out) == "from-the-tool\nbuilt\n"
    assert "TOOL_HOME" in cat_sif(sif, "/.singularity.d/env/90-environment.sh", out)
    assert not any(p.startswith(".tmax-build") for p in list_sif(sif))


def test_apptainer_definition_of_stages_on_different_bases(tmp_path):
    """Each stage is bootstrapped from its own base's SIF; one the build was not given is a
    clear error."""
    from tmax.images.plan import dockerfile_definition, dockerfile_over

    task = dockerfile_definition(
        "FROM gcc:14 AS build\nRUN make /out/tool\n"
        "FROM python:3.11-slim\nCOPY --from=build /out/tool /usr/local/bin/\n",
        lambda image: "buildpack-deps-trixie" if image.startswith("gcc") else "debian-slim")
    assert (task.base, task.stage_bases) == ("debian-slim", ("buildpack-deps-trixie",))
    text = dockerfile_over(task, Path("/store/bases/slim.sif"), tmp_path,
                           {"buildpack-deps-trixie": Path("/store/bases/bp.sif")})
    first, final = text.split("Bootstrap: localimage")[1:]
    assert first.startswith("\nFrom: /store/bases/bp.sif\nStage: s0\n")
    assert final.startswith("\nFrom: /store/bases/slim.sif\nStage: s1\n")
    with pytest.raises(BuildError, match="stage build starts from base 'buildpack-deps-trixie'"):
        dockerfile_over(task, Path("/store/bases/slim.sif"), tmp_path)


def test_a_bases_workdir_is_where_relative_paths_start(tmp_path):
    """The Terminal-Bench bases start in /app (their WORKDIR): `COPY data.csv ./` with no
    WORKDIR of its own lands in /app, as over the real image."""
    from tmax.images.store import ImageStore

    builds = ImageBuilds(ImageStore(tmp_path / "store"), LocalBuilder(tmp_path / "cache"))
    assert builds.base_workdir("t-bench") == "/app"
    assert builds.base_workdir("debian-slim") == "/"
    task = make_task(tmp_path, **{
        "environment/Dockerfile": "FROM ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624"
                                  "\nCOPY data.csv ./\n", "environment/data.csv": "a,b\n"})
    plan = builds.plan(load_task(task))
    assert plan.base == "t-bench-ubuntu" and plan.definition.workdir == "/app"
    (copy,) = plan.definition.stages[0][0].steps
    assert copy.dest == "/app/"


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the local builder needs root")
def test_run_steps_reach_https_registries_as_this_machine_does(tmp_path, image_store):
    """`RUN pip install` over HTTPS, with python:3.x's pip (no --break-system-packages): the
    step trusts this machine's certificates (a proxy's authority included), and the image
    keeps none of it."""
    result, store = _build(tmp_path, image_store,
                           "FROM python:3.11-slim\nRUN pip install --no-cache-dir -q "
                           "six==1.16.0 && python -c 'import six; print(six.__version__)' "
                           "> /six.txt\n", {})
    assert result.status == "built", result.error
    sif = store.path(store.read().tasks["demo"].sif)
    out = tmp_path / "o"
    out.mkdir()
    assert cat_sif(sif, "/six.txt", out) == "1.16.0\n"
    (tmp_path / "e").mkdir()
    env_file = cat_sif(sif, "/.singularity.d/env/90-environment.sh", tmp_path / "e")
    assert "SSL_CERT_FILE" not in env_file and ".tmax-build" not in list_sif(sif)


def test_add_of_a_url_is_fetched_at_staging(tmp_path):
    """ADD https?://... downloads the file (mode 600, as Docker) into the staged folder."""
    import http.server
    import threading

    from tmax.images.staging import stage_files

    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "tool.txt").write_text("fetched\n")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **k):
            super().__init__(*a, directory=str(tmp_path / "served"), **k)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/tool.txt"
        stage = parse(f"FROM d\nADD {url} /opt/\n").final
        stage_files(stage, tmp_path, tmp_path / "staged", image_root=lambda ref: tmp_path)
    finally:
        server.shutdown()
        thread.join()
    fetched = tmp_path / "staged" / "c2" / "0" / "tool.txt"
    assert fetched.read_text() == "fetched\n" and fetched.stat().st_mode & 0o777 == 0o600


def test_path_starts_as_the_base_images_path(tmp_path):
    """`ENV PATH=/root/.local/bin:${PATH}` over golang:*-bookworm keeps the Go image's
    /usr/local/go/bin, as over the real image (a real TB2 task lost `go` when ${PATH} was
    the default PATH); a Dockerfile that sets no PATH leaves the base's in place."""
    from tmax.images.store import ImageStore

    builds = ImageBuilds(ImageStore(tmp_path / "store"), LocalBuilder(tmp_path / "cache"))
    go_path = builds.base_path("golang-bookworm")
    assert go_path.startswith("/go/bin:/usr/local/go/bin:")
    task = make_task(tmp_path / "a", **{"environment/Dockerfile":
                                        "FROM golang:1.22-bookworm\n"
                                        "ENV PATH=\"/root/.local/bin:${PATH}\"\nRUN go version\n"})
    final = builds.plan(load_task(task)).definition.stages[-1][0]
    assert final.env["PATH"] == f"/root/.local/bin:{go_path}"
    (run,) = [s for s in final.steps if isinstance(s, Run)]
    assert dict(run.env)["PATH"] == f"/root/.local/bin:{go_path}"
    task = make_task(tmp_path / "b", **{"environment/Dockerfile":
                                        "FROM rust:1.83-slim\nRUN cargo --version\n"})
    assert builds.plan(load_task(task)).definition.stages[-1][0].env["PATH"] == \
        builds.base_path("rust") and "/usr/local/cargo/bin" in builds.base_path("rust")
    assert parse("FROM x\nENV PATH=/a:$PATH\n").final.env["PATH"] == f"/a:{DEFAULT_PATH}"


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the local builder needs root")
def test_pip_installs_system_wide_after_apt_reinstalls_python(tmp_path, image_store):
    """python:3.x and ubuntu:22.04 have no PEP 668 marker, so `pip install` works there; the
    Debian stand-ins keep it away even when apt (re)installs Python's standard library, as
    an upgrade from -updates/-security does (a real TB1 task's `pip3 install` failed so)."""
    result, store = _build(tmp_path, image_store,
                           "FROM python:3.11-slim\nRUN apt-get update -qq && apt-get install "
                           "-y -qq --reinstall libpython3.11-stdlib && pip install -q "
                           "--no-cache-dir six==1.16.0 && python -c 'import six' && "
                           "ls /usr/lib/python3.11/EXTERNALLY-MANAGED || echo absent > /pep668\n",
                           {})
    assert result.status == "built", result.error
    out = tmp_path / "o"
    out.mkdir()
    assert cat_sif(store.path(store.read().tasks["demo"].sif), "/pep668", out) == "absent\n"
