"""Files between a client and a worker: tar streams checked on the host (the worker's
``put``, ``get`` and ``verify``; see ``sandfleet.worker``)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path, PurePosixPath

from sandfleet.errors import BadRequest


def tar_bounded(path: Path, name: str, limit: int) -> bytes:
    """``path`` as a tar stream named ``name``, links stored as links (never followed);
    BadRequest past ``limit`` bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(path, arcname=name)
    if buf.tell() > limit:
        raise BadRequest(f"{path.name} is over {limit >> 20} MiB as a tar stream")
    return buf.getvalue()


def unpack_checked(data: bytes, name: str, dest: Path) -> Path:
    """Unpack a put's tar into ``dest``; every member must lie under ``name``."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members = tar.getmembers()
            if not members:
                raise BadRequest("put: empty archive")
            for member in members:
                parts = PurePosixPath(member.name).parts
                if member.name.startswith("/") or ".." in parts or not parts \
                        or parts[0] != name:
                    raise BadRequest(f"put: member {member.name!r} escapes {name!r}")
            tar.extractall(dest, members=members, filter="data")
    except tarfile.FilterError as e:
        raise BadRequest(f"put: unsafe archive: {e}") from None
    except tarfile.TarError as e:
        raise BadRequest(f"put: not a tar archive: {e}") from None
    return dest / name
