"""Compatibility: the wire's names where they were before it was split up.

The wire lives in ``sandfleet.wire`` (``messages``, ``frames``, ``transport``), its
exceptions in ``sandfleet.errors`` and controller discovery in ``sandfleet.discovery``;
import from those. This module only re-exports them, for code outside sandfleet's own
modules that still imports ``sandfleet.protocol`` (benchmarks/, ``config``, ``shell``).
"""

from sandfleet.discovery import CONTROLLER_FILE, ControllerInfo, read_controller_info, write_private
from sandfleet.errors import (
    REMOTE_ERRORS,
    BadRequest,
    LeaseClosed,
    ProtocolError,
    RemoteError,
    Unauthorized,
    UnknownLease,
    error_from_dict,
    error_to_dict,
)
from sandfleet.wire.frames import (
    FRAME_TIMEOUT_S,
    MAX_HEADER_BYTES,
    MAX_PAYLOAD_BYTES,
    PREAUTH_HEADER_BYTES,
    PREFIX,
    encode_frame,
    read_frame,
    settle,
    write_frame,
)
from sandfleet.wire.messages import (
    ID_MAX,
    PAYLOAD_BYTES,
    PROTOCOL_VERSION,
    REQUEST,
    Acquire,
    AnyRequest,
    Exec,
    ExecReply,
    Get,
    Grant,
    Heartbeat,
    LeaseActivity,
    Message,
    Ping,
    Put,
    Register,
    Release,
    Renew,
    Reply,
    Request,
    Shutdown,
    StartSandbox,
    Status,
    StopSandbox,
    Verify,
    VerifyReply,
    new_id,
)
from sandfleet.wire.transport import (
    IDLE_TIMEOUT_S,
    Connection,
    Handler,
    Peer,
    Server,
    WireLimits,
    check_token,
    new_event_loop,
    parse_address,
    run_event_loop,
)

__all__ = [  # noqa: RUF022 - grouped by letter case, one line per few names
    "CONTROLLER_FILE", "FRAME_TIMEOUT_S", "ID_MAX", "IDLE_TIMEOUT_S", "MAX_HEADER_BYTES",
    "MAX_PAYLOAD_BYTES", "PAYLOAD_BYTES", "PREAUTH_HEADER_BYTES", "PREFIX",
    "PROTOCOL_VERSION", "REMOTE_ERRORS", "REQUEST", "Acquire", "AnyRequest", "BadRequest",
    "Connection", "ControllerInfo", "Exec", "ExecReply", "Get", "Grant", "Handler",
    "Heartbeat", "LeaseActivity", "LeaseClosed", "Message", "Peer", "Ping", "ProtocolError",
    "Put", "Register", "Release", "RemoteError", "Renew", "Reply", "Request", "Server",
    "Shutdown", "StartSandbox", "Status", "StopSandbox", "Unauthorized", "UnknownLease",
    "Verify", "VerifyReply", "WireLimits", "check_token", "encode_frame", "error_from_dict",
    "error_to_dict", "new_event_loop", "new_id", "parse_address", "read_controller_info",
    "read_frame", "run_event_loop", "settle", "write_frame", "write_private",
]
