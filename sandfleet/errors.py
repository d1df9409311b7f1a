"""Sandfleet's exceptions, one family under ``SandfleetError``, and their wire form.

Two branches: ``InfraError`` (infrastructure) and ``RemoteError`` (a request the fleet
refused: a bad request, a bad token, a released lease, broken framing).

An ``InfraError`` is a failure the policy did not cause: rollouts record it as
``infra_failure`` with its ``cause`` and the trainer masks it instead of scoring a zero.
Policy outcomes (a command timeout, an OOM kill of the agent's own process) are results,
never exceptions.

Every error carries plain data (strings, numbers) named by ``fields``, so it pickles
across processes and crosses the wire as ``to_dict()``; ``InfraError.from_dict`` rebuilds
it on the other side from the allow-list ``ERRORS`` (an unknown name becomes a plain
``InfraError`` that keeps the message and cause). A ``RemoteError`` crosses as
``{"error": <name>, "message": ...}`` and is rebuilt from ``REMOTE_ERRORS``;
``error_to_dict`` and ``error_from_dict`` are the two ends of an error reply.
"""

from __future__ import annotations

from typing import Any, ClassVar


class SandfleetError(Exception):
    """The root of every error sandfleet raises: ``InfraError`` (infrastructure) and
    ``RemoteError`` (a request the fleet refused)."""


class InfraError(SandfleetError):
    """A failure the policy did not cause; rollouts record it and the trainer masks it."""

    cause: ClassVar[str] = "infra"
    fields: ClassVar[tuple[str, ...]] = ("message",)

    def __init__(self, message: str):
        self.message = message
        super().__init__(message)

    def __reduce__(self) -> tuple[type[InfraError], tuple[Any, ...]]:
        return (type(self), tuple(getattr(self, f) for f in self.fields))

    def to_dict(self) -> dict[str, Any]:
        """``{"error": class name, "cause", "message", <fields>}``, JSON-ready."""
        return {"error": type(self).__name__, "cause": self.cause, "message": str(self),
                **{f: getattr(self, f) for f in self.fields}}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> InfraError:
        """Rebuild an error sent with ``to_dict()``; only classes in ``ERRORS`` are built."""
        cls = ERRORS.get(data.get("error", ""))
        if cls is None or cls is InfraError:
            err = InfraError(str(data.get("message", "infrastructure failure")))
            err.cause = str(data.get("cause", InfraError.cause))  # type: ignore[misc]
            return err
        return cls(*(data[f] for f in cls.fields))


class _WithReason(InfraError):
    """An error about one named thing (``subject``, a field of the subclass) and why."""

    fields: ClassVar[tuple[str, ...]] = ()
    what: ClassVar[str] = ""

    def __init__(self, *args: Any):
        if len(args) != len(self.fields):
            raise TypeError(f"{type(self).__name__}({', '.join(self.fields)})")
        for name, value in zip(self.fields, args):
            setattr(self, name, value)
        super().__init__(self._format())

    def _format(self) -> str:
        subject, *rest = (getattr(self, f) for f in self.fields)
        return f"{self.what}{subject}: " + "; ".join(str(r) for r in rest)


class SandboxLost(_WithReason):
    """A sandbox that is gone: its processes died, it hit its max lifetime, or it never was."""

    cause = "sandbox_lost"
    fields = ("sandbox_id", "reason")
    what = "sandbox "
    sandbox_id: str
    reason: str


class LeaseExpired(SandboxLost):
    """A lease not renewed within its ttl (no renew, exec or running command): the fleet
    destroyed its sandbox. Its holder sees it only if it was alive (a client that could not
    renew in time: a stalled loop, an unreachable controller), so it is infrastructure from
    the policy's point of view; a SandboxLost, so handling of lost sandboxes applies."""

    cause = "lease_expired"


class SandboxStartError(_WithReason):
    """A sandbox that could not be started (the runtime failed, not the image)."""

    cause = "sandbox_start"
    fields = ("sandbox_id", "reason")
    what = "sandbox "
    sandbox_id: str
    reason: str


class ImageMissing(_WithReason):
    """A task image that is not in the store, out of date, truncated or corrupt."""

    cause = "image_missing"
    fields = ("image", "reason")
    image: str
    reason: str


class NodeLost(_WithReason):
    """A worker node that stopped answering or whose job ended."""

    cause = "node_lost"
    fields = ("node", "reason")
    what = "node "
    node: str
    reason: str


class CapacityTimeout(_WithReason):
    """No sandbox could be granted within the caller's wait limit."""

    cause = "capacity"
    fields = ("waited_s", "reason")
    what = "no capacity after "
    waited_s: float
    reason: str

    def _format(self) -> str:
        return f"no capacity after {self.waited_s:.1f}s: {self.reason}"


class ControllerUnreachable(_WithReason):
    """The fleet controller could not be reached (or its address is unknown)."""

    cause = "controller_unreachable"
    fields = ("address", "reason")
    what = "controller "
    address: str
    reason: str


ERRORS: dict[str, type[InfraError]] = {cls.__name__: cls for cls in (
    InfraError, SandboxLost, LeaseExpired, SandboxStartError, ImageMissing, NodeLost,
    CapacityTimeout, ControllerUnreachable)}


# ---- errors that are not infrastructure failures


class RemoteError(SandfleetError):
    """An error reply that is not an infrastructure failure (a bad request, a bad token)."""

    def __init__(self, message: str):
        self.message = message
        super().__init__(message)

    def to_dict(self) -> dict[str, Any]:
        return {"error": type(self).__name__, "message": self.message}


class ProtocolError(RemoteError):
    """Broken framing: the connection is closed."""


class BadRequest(RemoteError):
    """A message that does not parse or validate, or asks for something impossible."""


class Unauthorized(RemoteError):
    """A missing or wrong fleet token."""


class UnknownLease(RemoteError):
    """A worker that holds no such lease (the controller knows why: ask it)."""


class LeaseClosed(RemoteError):
    """A lease its holder already released."""


REMOTE_ERRORS: dict[str, type[Exception]] = {
    **{cls.__name__: cls for cls in (RemoteError, BadRequest, Unauthorized, UnknownLease,
                                     LeaseClosed)},
    "FileNotFoundError": FileNotFoundError,
    "TimeoutError": TimeoutError,
}
"""The error replies other than ``ERRORS`` that are rebuilt as themselves (ProtocolError is
not among them: it is raised where the framing breaks, never sent)."""


def error_to_dict(exc: BaseException) -> dict[str, Any]:
    """The wire form of an exception raised by a handler (a pydantic ValidationError is a
    ValueError: BadRequest)."""
    if isinstance(exc, (InfraError, RemoteError)):
        return exc.to_dict()
    if isinstance(exc, (FileNotFoundError, TimeoutError)):
        return {"error": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, (ValueError, KeyError)):
        return {"error": "BadRequest", "message": str(exc)[:2000]}
    return {"error": "RemoteError", "message": f"{type(exc).__name__}: {exc}"[:2000]}


def error_from_dict(data: dict[str, Any]) -> Exception:
    """Rebuild an error reply: infra errors from ``ERRORS``, others from ``REMOTE_ERRORS``."""
    name = str(data.get("error", ""))
    if name in ERRORS:
        return InfraError.from_dict(data)
    cls = REMOTE_ERRORS.get(name, RemoteError)
    message = str(data.get("message", name))
    if cls is RemoteError and name not in REMOTE_ERRORS:
        message = f"{name}: {message}"
    return cls(message)
