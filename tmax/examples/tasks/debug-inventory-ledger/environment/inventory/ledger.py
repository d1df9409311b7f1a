"""Stock level computation."""


def apply(movements, stock={}):
    """Apply ``movements`` to the opening ``stock`` and return the resulting levels.

    ``stock`` maps sku -> level (default: nothing in stock). Returns a new dict; neither
    argument is modified. ``IN`` adds ``qty``, ``OUT`` subtracts it; any other kind is an
    error (ValueError).
    """
    for m in movements:
        if m["kind"] == "IN":
            delta = m["qty"]
        elif m["kind"] == "OUT":
            delta = -m["qty"]
        else:
            raise ValueError(f"unknown movement kind {m['kind']!r} for sku {m['sku']!r}")
        stock[m["sku"]] = stock.get(m["sku"], 0) + delta
    return stock
