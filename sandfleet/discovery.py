"""Discovery: ``<state dir>/controller.json`` tells workers and clients where the
controller is and which token to present.

The controller writes it (``write_private``: atomically, mode 0600) once it listens; its
readers accept fields they do not know (``extra="allow"``, as for replies: a newer
controller's file still reads on an older client, see ``sandfleet.wire.messages``).
"""

from __future__ import annotations

import os
from pathlib import Path

from sandfleet.wire.messages import PROTOCOL_VERSION, Result

CONTROLLER_FILE = "controller.json"


class ControllerInfo(Result):
    """``<state dir>/controller.json`` (mode 0600): how workers and clients reach the
    controller, and the token they must present."""

    address: str
    """host:port the controller listens on, as others reach it."""
    token: str
    pid: int
    """The controller process (with ``pid_start``, its start time, it names it for good)."""
    pid_start: int | None = None
    host: str = ""
    """The machine the controller runs on."""
    started_at: float = 0.0
    v: int = PROTOCOL_VERSION


def read_controller_info(state_dir: str | os.PathLike) -> ControllerInfo | None:
    """The state dir's controller.json, or None when there is none (or it is unreadable)."""
    try:
        return ControllerInfo.model_validate_json(Path(state_dir, CONTROLLER_FILE).read_text())
    except (OSError, ValueError):
        return None


def write_private(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable and writable by its owner only."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
