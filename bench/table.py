"""Aligned text tables for the bench commands' output."""

from __future__ import annotations


def table(rows: list[tuple[str, ...]]) -> str:
    """Rows under the first (the header), in aligned columns."""
    header = rows[0]
    widths = [max(len(row[i]) for row in rows if len(row) == len(header)) for i in range(len(header))]
    # a FAILED row has two cells: zip stops early and its error runs on past the columns
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)
