"""Messages: every request and every reply on the fleet's wire, as typed models.

A request is a pydantic model with a ``type`` discriminator, carrying the protocol
version ``v``, a request id ``id`` and the fleet's ``token``; ``REQUEST`` parses any of
them. A reply (``Reply``) carries the request's ``id`` and either ``result`` or ``error``:
an infrastructure failure as ``InfraError.to_dict()``, anything else as
``{"error": <name>, "message": ...}`` (see ``sandfleet.errors``). Each request class names
the model of its result (``Request.Result``: ``Grant``, ``ExecReply``, ``HeartbeatReply``...);
``parse_result`` reads a reply's result with it. Servers send either that model or a dict
of exactly its fields (the controller's grant is built as a dict: it runs for every acquire
and renew); tests/unit/test_wire_compat.py holds the bytes of each, so a change of the format
fails there.

Unknown fields, and why the two directions differ (a rolling restart upgrades the
controller and the workers first, the clients after):

- Requests are ``extra="forbid"``: a server must never silently ignore something it was
  asked for (a new limit, a new isolation flag), so a new client talking to an old server
  gets ``BadRequest`` naming the field instead of a sandbox without it. A field added to a
  request therefore needs a default, so an old client's requests still parse on a new
  server.
- Replies (the ``Reply`` envelope and every result model), ``ControllerInfo`` and the
  other things the fleet's servers write for clients are ``extra="allow"``: a new
  controller may add a field and an old client keeps working. The field is kept, not
  dropped (``model.model_extra``) and logged once per process at INFO, so it is visible.
  Removing or retyping a reply field is a breaking change; ``sandbox_id`` is the example:

``Grant.sandbox_id`` always equals ``lease_id`` (the worker names the sandbox by its
lease). It stays on the wire because clients before this one require it; this client reads
a grant without it as ``sandbox_id = lease_id``, so a controller may stop sending it once no
older client is left.

Request ids make retries safe: the controller answers a repeated ``acquire`` id with the
lease it already granted (or joins the wait already under way); ``renew`` and ``release``
are idempotent anyway.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    model_serializer,
    model_validator,
)

from sandfleet.netproxy import HostAllowlist
from sandfleet.wire.frames import MAX_PAYLOAD_BYTES

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
ID_MAX = 128
PAYLOAD_BYTES: dict[str, int] = {"put": MAX_PAYLOAD_BYTES, "verify": MAX_PAYLOAD_BYTES}
"""Largest payload of each request type; any other request carries none."""


R = TypeVar("R", bound="Result")


def _check_hosts(hosts: tuple[str, ...]) -> tuple[str, ...]:
    HostAllowlist(hosts)  # ValueError naming a bad entry
    return hosts


AllowedHosts = Annotated[tuple[str, ...], Field(max_length=1024), AfterValidator(_check_hosts)]


def _omit_empty(data: Any, key: str) -> Any:
    """A field added to a request after others: left out while it has its empty default."""
    if isinstance(data, dict) and not data.get(key):
        data.pop(key, None)
    return data


class Message(BaseModel):
    """What a peer sends that the receiver must understand whole: unknown fields rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Result(BaseModel):
    """What a server sends back (and writes for clients): unknown fields kept and noted."""

    model_config = ConfigDict(extra="allow", frozen=True)

    def model_post_init(self, context: Any, /) -> None:
        if self.__pydantic_extra__:
            note_unknown(type(self).__name__, self.__pydantic_extra__)


_noted: set[tuple[str, str]] = set()


def note_unknown(model: str, extra: dict[str, Any]) -> None:
    """Log each field a newer peer sent that this code does not know, once per process."""
    for name in extra:
        if (model, name) not in _noted and len(_noted) < 1024:
            _noted.add((model, name))
            log.info("%s carries a field this sandfleet does not know: %r (a newer fleet?); "
                     "kept in model_extra", model, name)


# ---- results: what each request's reply carries


class PingReply(Result):
    role: str = ""
    """``controller`` or ``worker``."""
    address: str = ""
    """The controller's address (a controller's reply)."""
    worker_id: str = ""
    """A worker's reply: its id and how many leases it runs."""
    leases: int = 0


class Grant(Result):
    """The result of ``acquire`` and ``renew``: the lease as it stands."""

    lease_id: str
    sandbox_id: str
    """Always ``lease_id`` (see the module doc); filled in from it when absent."""
    worker_id: str
    worker_address: str
    node: str
    granted_at: float
    """Wall-clock time of the grant: the rollout's time budget starts here."""
    queued_s: float
    """Seconds the acquire waited for a free slot (the sandbox's start is not included)."""
    expires_at: float
    ttl_s: float
    state: str = "held"
    """starting | held (sent by ``renew``, and by a repeated ``acquire``, which the
    controller answers as a renew)."""

    @model_validator(mode="before")
    @classmethod
    def _sandbox_is_lease(cls, data: Any) -> Any:
        if isinstance(data, dict) and "sandbox_id" not in data and "lease_id" in data:
            return {**data, "sandbox_id": data["lease_id"]}
        return data


class ReleaseReply(Result):
    released: bool = True
    was: str | None = None
    """``held`` when this release ended the lease, else the cause it had ended by (None:
    unknown to this controller)."""


class NodeStatus(Result):
    worker_id: str
    name: str = ""
    node: str = ""
    address: str = ""
    state: str = ""
    slots: int = 0
    used_cpus: int = 0
    leases: int = 0
    job_id: str = ""
    last_seen_s: float = 0.0
    idle_s: float = 0.0
    ends_in_s: float | None = None


class LeaseCounts(Result):
    held: int = 0
    starting: int = 0
    queued: int = 0
    queued_by_client: dict[str, int] = Field(default_factory=dict)


class JobStatus(Result):
    job_id: str
    name: str = ""
    state: str = ""


class StatusReply(Result):
    """The result of ``status`` (``sandfleet status``)."""

    address: str = ""
    pid: int = 0
    state_dir: str = ""
    provider: str = ""
    uptime_s: float = 0.0
    nodes: list[NodeStatus] = Field(default_factory=list)
    leases: LeaseCounts = Field(default_factory=LeaseCounts)
    jobs: list[JobStatus] = Field(default_factory=list)
    failures: dict[str, int] = Field(default_factory=dict)
    """Failures by cause since the controller started."""
    recent_failures: list[dict[str, Any]] = Field(default_factory=list)


class ShutdownReply(Result):
    stopping: bool = True


class RegisterReply(Result):
    known: bool = True
    keep: list[str] = Field(default_factory=list)
    """The leases the worker reported that it should keep running (stop the others)."""
    heartbeat_s: float | None = None


class HeartbeatReply(Result):
    known: bool = True
    """False: the controller does not know this worker (it registers again)."""
    stop: list[str] = Field(default_factory=list)
    """Leases to stop."""
    drain: bool = False


class StartReply(Result):
    started: bool = True


class StopReply(Result):
    stopped: bool = True


class ExecReply(Result):
    """The result of ``exec``; the output (UTF-8) is the payload."""

    exit_code: int
    timed_out: bool
    oom: bool
    duration_s: float


class VerifyReply(ExecReply):
    """The result of ``verify``; the payload is the tar stream of /logs/verifier."""

    output: str
    """The verifier's stdout and stderr (its last 64 KiB)."""


class FileReply(Result):
    """The result of ``put`` and ``get`` (a get's tar stream is the payload)."""

    path: str
    bytes: int


# ---- requests


class Request(Message):
    Result: ClassVar[type[Result]]
    """The model of this request's result."""

    v: int = PROTOCOL_VERSION
    """Protocol version; a server answers other versions with BadRequest."""
    id: str = Field(min_length=1, max_length=ID_MAX)
    """Request id: the reply carries it; a retry reuses it."""
    token: str = Field(default="", max_length=256)
    """The fleet's auth token (from the state dir's controller.json)."""
    type: str
    """The discriminator: each request class fixes it (``ping``, ``acquire``...)."""


class Ping(Request):
    Result = PingReply
    type: Literal["ping"] = "ping"


class Acquire(Request):
    """Client -> controller: a sandbox lease, granted when a worker slot is free."""

    Result = Grant
    type: Literal["acquire"] = "acquire"
    image: str = Field(min_length=1, max_length=4096)
    """Path of the SIF image, readable on the worker nodes."""
    cpus: int = Field(default=2, ge=1, le=1024)
    memory_mb: int = Field(default=2048, ge=16)
    storage_mb: int | None = Field(default=None, ge=16)
    """Disk quota of the sandbox's writable layer (the fleet's default if unset)."""
    ttl_s: float | None = Field(default=None, gt=0, le=7 * 86400)
    """The lease expires this long after its last renewal (the fleet's default if unset)."""
    network: bool = False
    wait_s: float | None = Field(default=None, ge=0)
    """How long to queue for capacity before CapacityTimeout (the fleet's default if
    unset)."""
    client: str = Field(default="", max_length=256)
    """Who asks (fair queueing is round-robin over clients)."""
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str = "/"
    max_lifetime_s: float | None = Field(default=None, gt=0)
    """Hard deadline of the sandbox; the fleet's maximum when unset or larger."""
    user: str = Field(default="", max_length=65,
                      pattern=r"^([A-Za-z0-9_][A-Za-z0-9_.-]*(:[A-Za-z0-9_][A-Za-z0-9_.-]*)?)?$")
    """Who the sandbox's commands run as (Docker's USER; "" is root): ``SandboxSpec.user``."""
    allowed_hosts: AllowedHosts = ()
    """The allowlist network (``SandboxSpec.allowed_hosts``). Sent only when not empty, so a
    request without it is the bytes it was before and an older server still reads it; one
    with it gets BadRequest from a server that cannot enforce it."""

    @model_serializer(mode="wrap")
    def _omit_no_hosts(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _omit_empty(handler(self), "allowed_hosts")


class Renew(Request):
    """Client -> controller: push the lease's expiry to now + ttl; its state back."""

    Result = Grant
    type: Literal["renew"] = "renew"
    lease_id: str = Field(max_length=ID_MAX)


class Release(Request):
    Result = ReleaseReply
    type: Literal["release"] = "release"
    lease_id: str = Field(max_length=ID_MAX)


class Status(Request):
    Result = StatusReply
    type: Literal["status"] = "status"


class Shutdown(Request):
    """To the controller: ``sandfleet down``. To a worker: stop sandboxes and exit."""

    Result = ShutdownReply
    type: Literal["shutdown"] = "shutdown"
    reason: str = ""


class LeaseActivity(Message):
    idle_s: float
    """Seconds since the lease's last exec, put or get started or ended."""
    pinned: bool = False
    """A command is running on it now (pinned leases do not expire)."""


class Register(Request):
    """Worker -> controller, at start and whenever the controller does not know it."""

    Result = RegisterReply
    type: Literal["register"] = "register"
    worker_id: str = Field(max_length=ID_MAX)
    name: str = Field(default="", max_length=256)
    """The provider's name for the worker (``local-0``, the Slurm job id)."""
    address: str = Field(max_length=512)
    node: str = Field(max_length=256)
    slots: int = Field(ge=1)
    """CPUs this worker hands out."""
    memory_mb: int = Field(ge=16)
    job_id: str = Field(default="", max_length=128)
    ends_at: float | None = None
    """Wall-clock time the worker's job ends (Slurm time limit), if any."""
    leases: dict[str, LeaseActivity] = Field(default_factory=dict)
    """Sandboxes it runs now, by lease id."""


class Heartbeat(Request):
    Result = HeartbeatReply
    type: Literal["heartbeat"] = "heartbeat"
    worker_id: str = Field(max_length=ID_MAX)
    leases: dict[str, LeaseActivity] = Field(default_factory=dict)
    lost: dict[str, str] = Field(default_factory=dict)
    """Leases whose sandbox died under the worker: lease id -> reason."""
    leaving: str = Field(default="", max_length=1000)
    """Set by a worker about to exit (SIGTERM, scancel, preemption, time limit): why. Its
    leases then fail with NodeLost at once instead of after ``lost_after_s``."""


class SandboxSpecModel(Message):
    """``sandfleet.runtime.base.SandboxSpec`` as it crosses the wire (the same fields, in
    the same order, with the same bounds; tests/unit/test_wire_compat.py checks they match)."""

    image: str = Field(min_length=1, max_length=4096)
    """Path of the SIF file on the worker's node."""
    cpus: int = Field(default=2, ge=1)
    memory_mb: int = Field(default=2048, ge=16)
    storage_mb: int = Field(default=10240, ge=16)
    network: bool = False
    max_lifetime_s: float = Field(default=4 * 3600.0, gt=0)
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str = "/"
    hostname: str = "sandbox"
    user: str = Field(default="", max_length=65)
    allowed_hosts: AllowedHosts = ()
    """The allowlist network (``SandboxSpec.allowed_hosts``). Sent only when not empty, so a
    request without it is the bytes it was before and an older server still reads it; one
    with it gets BadRequest from a server that cannot enforce it."""

    @model_serializer(mode="wrap")
    def _omit_no_hosts(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _omit_empty(handler(self), "allowed_hosts")


class StartSandbox(Request):
    """Controller -> worker: start the lease's sandbox; replies once commands can run."""

    Result = StartReply
    type: Literal["start_sandbox"] = "start_sandbox"
    lease_id: str = Field(max_length=ID_MAX)
    spec: SandboxSpecModel


class StopSandbox(Request):
    Result = StopReply
    type: Literal["stop_sandbox"] = "stop_sandbox"
    lease_id: str = Field(max_length=ID_MAX)
    reason: str = ""


class Exec(Request):
    """Client -> worker: one command in the lease's persistent shell."""

    Result = ExecReply
    type: Literal["exec"] = "exec"
    lease_id: str = Field(max_length=ID_MAX)
    command: str = Field(max_length=1 << 20)
    timeout: float = Field(gt=0, le=7 * 86400)


class Put(Request):
    """Client -> worker: the payload (a tar stream) unpacked at ``path`` in the sandbox.

    The archive holds one member tree named ``name``; it lands as ``path`` (file or dir).
    """

    Result = FileReply
    type: Literal["put"] = "put"
    lease_id: str = Field(max_length=ID_MAX)
    path: str = Field(min_length=1, max_length=4096)
    name: str = Field(min_length=1, max_length=255)


class Get(Request):
    """Client -> worker: a tar stream of ``path`` (one member tree named by its basename)."""

    Result = FileReply
    type: Literal["get"] = "get"
    lease_id: str = Field(max_length=ID_MAX)
    path: str = Field(min_length=1, max_length=4096)


class Verify(Request):
    """Client -> worker: run a task's verifier beside the lease's sandbox.

    The payload is a tar stream of the tests folder (one member tree named ``name``), which
    the verifier sees as /tests; the reply's payload is a tar stream of what it left in
    /logs/verifier (one member tree named ``verifier``). See the runtime's ``verify``.
    """

    Result = VerifyReply
    type: Literal["verify"] = "verify"
    lease_id: str = Field(max_length=ID_MAX)
    name: str = Field(min_length=1, max_length=255)
    command: list[str] = Field(min_length=1, max_length=256)
    cwd: str | None = Field(default=None, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    timeout: float = Field(gt=0, le=7 * 86400)
    agent_system: bool = False
    """Let the verifier run the agent's system tools (/usr, /bin, /lib, /etc) instead of
    the image's: a task opts in when it grades what the agent installed."""
    user: str = Field(default="", max_length=65,
                      pattern=r"^([A-Za-z0-9_][A-Za-z0-9_.-]*(:[A-Za-z0-9_][A-Za-z0-9_.-]*)?)?$")
    """Who the verifier's command runs as (Docker's USER, as the image names it; "" is
    root)."""


AnyRequest = Annotated[Ping | Acquire | Renew | Release | Status | Shutdown | Register
                       | Heartbeat | StartSandbox | StopSandbox | Exec | Put | Get | Verify,
                       Field(discriminator="type")]
REQUEST: TypeAdapter[AnyRequest] = TypeAdapter(AnyRequest)


class Reply(Result):
    """The envelope of every answer: the request's id, then ``result`` or ``error``."""

    type: Literal["reply"] = "reply"
    v: int = PROTOCOL_VERSION
    id: str = Field(max_length=ID_MAX)
    ok: bool
    result: dict[str, Any] = Field(default_factory=dict)
    """The request's ``Result``, as JSON (``parse_result`` types it)."""
    error: dict[str, Any] | None = None
    """``sandfleet.errors.error_to_dict`` of the failure (``error_from_dict`` rebuilds it)."""


def reply_header(rid: str, *, result: dict[str, Any] | BaseModel | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``Reply`` as the frame header servers send (a dict: no model per reply)."""
    return {"type": "reply", "v": PROTOCOL_VERSION, "id": rid, "ok": error is None,
            "result": {} if result is None else result, "error": error}


def validation_summary(e: ValidationError) -> str:
    """The first few problems of a message that failed validation, on one line."""
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'message'}: {err['msg']}"
                     for err in e.errors()[:5])


def parse_result(model: type[R], result: dict[str, Any]) -> R:
    """A reply's result as ``model`` (a request's ``Result``); unknown fields are kept."""
    return model.model_validate(result)


_ids = itertools.count()
_id_prefix = os.urandom(4).hex()


def new_id(prefix: str = "r") -> str:
    """A request id unique to this process and, with high probability, the fleet (the
    random tail, from ``random``'s generator, which is reseeded in a forked child, tells a
    fork's ids from its parent's; no system call per id)."""
    return f"{prefix}{_id_prefix}{next(_ids):x}{random.getrandbits(24):06x}"
