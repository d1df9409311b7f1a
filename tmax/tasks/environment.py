"""The image's environment, as a fresh sandbox of it has it before the agent acts: what
test.sh gets (``docker exec`` gives Harbor's verifiers the container's ENV).

It is read inside the sandbox (``PROBE``, run before anything else there), never by running
the image's %environment on the host: a task's ENV is the task author's text.
"""

from __future__ import annotations

import base64
import binascii

from sandfleet import netproxy

PROBE = "env -0 | base64 -w0"
"""Prints the environment NUL-separated, base64-encoded (no byte of it can break the
transport)."""

DROPPED = frozenset({"PWD", "OLDPWD", "SHLVL", "_",  # the probing shell's own
                     "LD_PRELOAD", "LD_AUDIT",  # code injected into every verifier process
                     "UV_NO_CONFIG", "PIP_CONFIG_FILE"})  # the runtime's: no agent-written
"""Variables the verifier does not take from the image."""  # tool config
LEASE_PROXY = netproxy.proxy_env()
"""The allowlist network's variables (``sandfleet.netproxy``): the agent's lease's, not the
image's; the verifier runs offline, and a proxy it cannot reach would hide why."""


def parse_probe(output: str) -> dict[str, str]:
    """The variables ``PROBE`` printed, minus ``DROPPED``; {} for output that is not
    its (an image without base64 or env: the verifier then gets only PATH)."""
    try:
        raw = base64.b64decode(output.strip(), validate=True)
    except (binascii.Error, ValueError):
        return {}
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        name = key.decode("utf-8", "replace")
        text = value.decode("utf-8", "replace")
        if sep and name and name not in DROPPED and "\n" not in name \
                and LEASE_PROXY.get(name) != text:
            env[name] = text
    return env


def trust_repositories(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus git's ``safe.directory=*`` as one more command-scope setting
    (``GIT_CONFIG_COUNT``; after any the environment already sets).

    TMax runs test.sh as root; Harbor runs it as the image's USER, who owns the
    repositories the agent worked in, and git refuses a repository another user owns
    ("detected dubious ownership"). A verifier running as that user would read the
    agent's repositories, their configuration included, as this one now does."""
    count = env.get("GIT_CONFIG_COUNT", "0")
    n = int(count) if count.isdigit() else 0
    return {**env, f"GIT_CONFIG_KEY_{n}": "safe.directory", f"GIT_CONFIG_VALUE_{n}": "*",
            "GIT_CONFIG_COUNT": str(n + 1)}


def verifier_env(image_env: dict[str, str], path: str,
                 task_env: dict[str, str]) -> dict[str, str]:
    """test.sh's environment: the image's (``image_env``), PATH ``path``, git's trust in
    the agent's repositories (``trust_repositories``), then the task's verifier env, which
    wins."""
    return {**trust_repositories({**image_env, "PATH": path}), **task_env}
