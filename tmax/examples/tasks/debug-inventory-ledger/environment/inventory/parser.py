"""Parsing of stock movement files.

A movement file is CSV text with the header ``date,warehouse,sku,qty,kind``. Fields may be
surrounded by spaces, lines may end with LF or CRLF, and blank lines are ignored. ``kind``
is ``IN`` or ``OUT``.
"""

FIELDS = ("date", "warehouse", "sku", "qty", "kind")


def parse_line(line):
    """Parse one data line into a movement dict (``qty`` as int)."""
    values = line.split(",")
    if len(values) != len(FIELDS):
        raise ValueError(f"bad line: {line!r}")
    movement = dict(zip(FIELDS, values))
    movement["qty"] = int(movement["qty"])
    return movement


def parse_file(path):
    """Return the list of movements of the file at ``path``, in file order."""
    with open(path, newline="") as f:
        lines = f.read().split("\n")
    return [parse_line(line) for line in lines[1:] if line.strip()]
