"""The parts of the verifier plan (``sandfleet.verifier.plan``) the Apptainer verifier
applies with ``--bind`` and its ``env K=V`` prefix, over the image's system folders that
``apptainer_verify`` binds already:

- the verifier tools' settings (``/.tmax/verifier/env``), PATH with the image's folders
  first (``trusted_first``);
- every PATH folder of the image outside the system folders (``path_roots``: /opt/venv, a
  top-level /venv with a ``pyvenv.cfg``), bound read-only from the image as built (the
  local runtime gives a writable layer of the verifier's: here a ``pip install`` into it
  fails);
- ``PYTHON_DIR`` with TMax's ``sitecustomize`` (``pathguard``) first on ``PYTHONPATH``;
- uv's installed Pythons: the image's folder (read-only), else ``NO_UV_PYTHONS``
  (``UV_PYTHON_INSTALL_DIR``, unless the task's env sets it);
- ``$HOME/.curlrc``: the image's, else an empty one in ``PYTHON_DIR``, named by
  ``CURL_HOME`` (curl reads it before ``$HOME``'s; Apptainer binds no file over a path the
  agent's tree lacks);
- where the tools hold uv, the installer stand-in's ``$HOME/.local/bin/{uv,uvx,env}`` (uv
  and uvx: scripts that exec the image's tools; env: ``INSTALLER_ENV``), as a folder of
  the verifier's bound over the agent's ``$HOME/.local/bin`` (the local runtime binds the
  three files and leaves the agent's others: here they are hidden from the verifier).

A bind follows a link the agent left at its destination (inside the container): the
verifier then reads the bound file through the same link. What the image has is learnt by
running the image itself (``probe``), cached per image version and question.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from sandfleet.runtime import layers
from sandfleet.verifier.plan import (
    HOME_CONFIG,
    INSTALLER_ENV,
    INSTALLER_FILES,
    NO_UV_PYTHONS,
    OVERLAY_SAFE,
    PATH_KEEP,
    PRISTINE,
    PYTHON_DIR,
    UV_PYTHONS,
    VENV_MARKERS,
    VERIFIER_TOOLS,
    path_roots,
    pathguard_source,
    tools_env,
    trusted_first,
)

PROBE_SH = r"""
for p in "$@"; do
  if [ -L "$p" ]; then echo "link $p"
  elif [ -d "$p" ]; then echo "dir $p"
  elif [ -f "$p" ]; then echo "file $p"
  fi
done
echo "path $PATH"
echo "--- env"
cat /.tmax/verifier/env 2>/dev/null || true
"""
FIXED = [f"{VERIFIER_TOOLS}/bin/uv", f"{VERIFIER_TOOLS}/bin/uvx"]


def probe(apptainer: str, image: Path, squash: Path, run_env: dict[str, str],
          timeout: float, paths: list[str]) -> dict:
    """{"kinds": {path: kind}, "path": the image's PATH, "tools_env": its tools' env file}
    of the image as built, cached next to its squashfs per set of ``paths``."""
    key = hashlib.sha1("\0".join(sorted(set(paths))).encode()).hexdigest()[:16]
    cache = squash.with_suffix(f".probe-{key}.json")
    if cache.exists():
        return json.loads(cache.read_text())
    out = subprocess.run([apptainer, "exec", "--containall", "--cleanenv", "--no-home",
                          "--userns", *layers.apptainer_args(image), "sh", "-c", PROBE_SH, "sh",
                          *sorted(set(paths))],
                         capture_output=True, text=True, env=run_env, timeout=timeout,
                         stdin=subprocess.DEVNULL, check=False)
    if out.returncode != 0:
        raise OSError(f"probing {image} for the verifier failed ({out.returncode}): "
                      f"{out.stderr[-800:]}")
    head, _, env_text = out.stdout.partition("--- env\n")
    kinds: dict[str, str] = {}
    image_path = ""
    for line in head.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "path":
            image_path = rest
        elif kind in ("dir", "file", "link"):
            kinds[rest] = kind
    seen = {"kinds": kinds, "path": image_path, "tools_env": env_text}
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
    tmp.write_text(json.dumps(seen))
    os.replace(tmp, cache)
    return seen


def _prefixes(path: str) -> list[str]:
    parts = path.strip("/").split("/")
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _home_ok(home: str) -> bool:
    parts = [p for p in home.split("/") if p not in ("", ".")]
    return home.startswith("/") and ".." not in parts and bool(parts) and \
        OVERLAY_SAFE.fullmatch(home) is not None and \
        parts[0] not in PRISTINE + PATH_KEEP + (".tmax",)


def verifier_view(ask, squash: Path, work: Path, base: dict[str, str], *, workdir: str,
                  cwd: str | None, agent_system: bool) -> tuple[list[str], dict[str, str]]:
    """``--bind`` arguments and the verifier's env (see the module doc). ``ask(paths)``:
    ``probe`` of the image for those paths; ``work``: a host folder of this call for the
    files bound; ``base``: defaults, the sandbox's env, the task's verifier env."""
    fixed = ask(FIXED)
    env = dict(base)
    env.setdefault("HOME", "/root")
    env.setdefault("PATH", fixed["path"] or os.defpath)
    for key, value in tools_env(fixed["tools_env"]).items():
        env[key] = value.replace("$PATH", env.get(key, "")) if key == "PATH" else value
    if agent_system:
        return [], env
    home = os.path.normpath(env["HOME"])
    candidates = path_roots(env["PATH"], keep=[workdir] + ([cwd] if cwd else []),
                            top_level=lambda root: True)
    questions = [s for r in candidates for s in _prefixes(r)] + \
        [f"{r}/{m}" for r in candidates for m in VENV_MARKERS]
    if _home_ok(home):
        questions += _prefixes(f"{home}/{UV_PYTHONS}") + [f"{home}/{n}" for n in HOME_CONFIG]
    kinds = ask(FIXED + questions)["kinds"]
    binds: list[str] = []
    bound = [f"/{n}" for n in PRISTINE] + [VERIFIER_TOOLS]
    for root in candidates:
        if not OVERLAY_SAFE.fullmatch(root) or \
                not all(kinds.get(s) == "dir" for s in _prefixes(root)):
            continue
        if root.count("/") == 1 and not any(kinds.get(f"{root}/{m}") for m in VENV_MARKERS):
            continue  # a top-level folder that is no venv: the agent's work
        binds += ["--bind", f"{squash}:{root}:image-src={root},ro"]
        bound.append(root)
    (work / "python").mkdir()
    (work / "python" / "sitecustomize.py").write_text(pathguard_source())
    binds += ["--bind", f"{work / 'python'}:{PYTHON_DIR}:ro"]
    env["PYTHONPATH"] = ":".join([PYTHON_DIR] + [p for p in env.get("PYTHONPATH", "")
                                                 .split(":") if p])
    uv_pythons = NO_UV_PYTHONS
    if _home_ok(home):
        folder = f"{home}/{UV_PYTHONS}"
        if any(_within(folder, b) for b in bound):
            uv_pythons = folder
        elif all(kinds.get(s) == "dir" for s in _prefixes(folder)):
            binds += ["--bind", f"{squash}:{folder}:image-src={folder},ro"]
            uv_pythons = folder
        for name in HOME_CONFIG:  # (.curlrc: curl reads $CURL_HOME's before $HOME's)
            path = f"{home}/{name}"
            if any(_within(path, b) for b in bound):
                continue
            if kinds.get(path) == "file" and all(kinds.get(s) == "dir" for s in _prefixes(home)):
                binds += ["--bind", f"{squash}:{path}:image-src={path},ro"]
            else:
                (work / "python" / name).write_text("")
                env.setdefault("CURL_HOME", PYTHON_DIR)
        installer = f"{home}/.local/bin"
        tools_uv = all(kinds.get(f) == "file" for f in FIXED)
        if tools_uv and not any(_within(installer, b) for b in bound):
            # a folder (Apptainer makes a missing folder, not a missing file, to bind on):
            # the agent's other files there are not the verifier's
            (work / "installer").mkdir()
            for name in INSTALLER_FILES:
                text = INSTALLER_ENV if name == "env" else \
                    f'#!/bin/sh\nexec {VERIFIER_TOOLS}/bin/{name} "$@"\n'
                (work / "installer" / name).write_text(text)
                (work / "installer" / name).chmod(0o755)
            binds += ["--bind", f"{work / 'installer'}:{installer}:ro"]
    env.setdefault("UV_PYTHON_INSTALL_DIR", uv_pythons)
    env["PATH"] = trusted_first(env["PATH"], bound)
    return binds, env
