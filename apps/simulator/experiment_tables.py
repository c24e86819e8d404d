"""What the seed experiments' reports share: a mean that tolerates no values, a figure formatted for a table,
and the table of a quantity, the seed's figure and ours."""

from __future__ import annotations

from typing import Any


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(rows: list[tuple[str, Any, Any, str]]) -> str:
    lines = ["| quantity | seed | ours | note |", "|---|---|---|---|"]
    lines += [f"| {name} | {fmt(seed)} | {fmt(ours)} | {note} |" for name, seed, ours, note in rows]
    return "\n".join(lines)
