"""What the benchmark scripts share: the machine line and the report output."""

from __future__ import annotations

import json
import logging
import os
import platform
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def machine() -> str:
    """CPU model, CPU count, memory and load: the context every figure is measured in."""
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "?")
    mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 30
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{os.cpu_count()} CPUs ({cpu}), {mem} GiB, load avg {load} at start"


def emit(report: dict[str, Any], header: str, table: str, out: Path | None) -> None:
    """Print the header line and the table; write the report as JSON to ``out`` if given."""
    print(f"# {header}")
    print(table)
    if out:
        out.write_text(json.dumps(report, indent=2) + "\n")
        log.info("wrote %s", out)
