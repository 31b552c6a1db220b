"""Text tables of ``torchtsp plan``: every column as wide as its widest cell, so that no row (a layout that
cannot run, a long label) shifts the others; numbers right-aligned, words left-aligned."""

from __future__ import annotations

GB = 1e9  # decimal gigabytes, as GPU memory is quoted (an "80 GB" H100)


def gb(nbytes: float, decimals: int = 1) -> str:
    """Bytes as decimal GB with thousands separators: one unit for every byte column of a table."""
    return f"{nbytes / GB:,.{decimals}f}"


def count(value: float) -> str:
    """A count (tokens, tokens/s, sequence length) as a whole number with thousands separators."""
    return f"{value:,.0f}"


def render(headers: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,), indent: str = "") -> list[str]:
    """The header, a rule and one line per row; the columns numbered in ``left`` are left-aligned (the last one
    unpadded), the others right-aligned."""
    widths = [max(len(r[i]) for r in (headers, *rows)) for i in range(len(headers))]

    def line(cells):
        parts = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return (indent + "  ".join(parts)).rstrip()

    head = line(headers)
    return [head, indent + "-" * (len(head) - len(indent)), *(line(r) for r in rows)]
