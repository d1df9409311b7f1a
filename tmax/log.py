"""The one logging setup of TMax's command-line tools (library code only logs)."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET = ("httpx", "httpcore", "aiohttp.access")
"""Libraries that log every request at INFO: shown from -vv (DEBUG) only."""


def setup(verbose: int = 0, *, default: int = logging.WARNING) -> None:
    """Log to stderr at ``default`` (WARNING), -v INFO, -vv DEBUG; a second call changes
    the level only."""
    levels = [default, logging.INFO, logging.DEBUG]
    level = levels[min(verbose, 2)] if verbose else default
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format=FORMAT)
    root.setLevel(level)
    for chatty in QUIET:  # one line per HTTP request is noise unless debugging
        logging.getLogger(chatty).setLevel(max(level, logging.WARNING) if level > logging.DEBUG
                                           else level)
