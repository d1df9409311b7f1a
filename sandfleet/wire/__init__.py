"""The fleet's wire: typed, versioned, authenticated messages over TCP.

- ``messages``: every request (``extra="forbid"``) and every reply (``extra="allow"``),
  the sandbox spec as it crosses, request ids; why the two directions differ.
- ``frames``: the one framing implementation (length-prefixed JSON header plus a raw
  payload), its limits, and the readers servers and both clients share.
- ``server``: ``Server`` over asyncio (the token before the payload, limits per peer),
  ``WireLimits``, ``Peer``.
- ``transport``: ``Connection``, the client end, and the event loop (uvloop where
  installed).

The exceptions are ``sandfleet.errors`` (one family under ``SandfleetError``), controller
discovery is ``sandfleet.discovery``. Nothing is imported here: import the module you need.
"""
