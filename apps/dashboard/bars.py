"""Reserved-vs-capacity bars for the pool page: pure functions, rendered as plain HTML/CSS by the template."""

from __future__ import annotations

from dataclasses import dataclass

# Above this share of capacity a bar turns amber: little headroom is left for new entitlements.
HIGH_WATERMARK_PERCENT = 80.0


def format_quantity(value: float, unit: str) -> str:
    """A number as an operator reads it: bytes in binary units, everything else with thousands separators."""
    if unit == "bytes":
        return format_bytes(value)
    text = f"{int(value):,}" if float(value).is_integer() else f"{value:,.1f}"
    return f"{text} {unit}".strip()


def format_bytes(value: float) -> str:
    size = float(value)
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or suffix == "TiB":
            return f"{int(size)} {suffix}" if suffix == "B" else f"{size:,.2f} {suffix}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


@dataclass(frozen=True)
class UsageBar:
    """One resource dimension of a pool: how much the bound entitlements reserve out of what it has."""

    key: str
    label: str
    reserved: float
    capacity: float
    unit: str

    @property
    def percent(self) -> float:
        """Reserved share of capacity, 0..100 for the bar's width (an over-commit still fills it only once)."""
        if self.capacity <= 0:
            return 100.0 if self.reserved > 0 else 0.0
        return max(0.0, min(100.0, 100.0 * self.reserved / self.capacity))

    @property
    def raw_percent(self) -> float | None:
        """Reserved share without clamping, so an over-committed pool shows e.g. 130%."""
        if self.capacity <= 0:
            return None
        return 100.0 * self.reserved / self.capacity

    @property
    def level(self) -> str:
        if self.capacity <= 0:
            return "full" if self.reserved > 0 else "ok"
        if self.reserved >= self.capacity:
            return "full"
        if self.percent >= HIGH_WATERMARK_PERCENT:
            return "high"
        return "ok"

    @property
    def free(self) -> float:
        return max(0.0, self.capacity - self.reserved)

    @property
    def reserved_display(self) -> str:
        return format_quantity(self.reserved, self.unit)

    @property
    def capacity_display(self) -> str:
        return format_quantity(self.capacity, self.unit)

    @property
    def free_display(self) -> str:
        return format_quantity(self.free, self.unit)


def usage_bars(*, reserved: dict[str, float], capacity: dict[str, float]) -> list[UsageBar]:
    """The pool page's three bars (slots, tokens/s, KV bytes), in a fixed order.

    ``reserved`` and ``capacity`` are keyed by ``slots``, ``tokens_per_second`` and ``kv_bytes``; a missing
    key counts as zero so a pool without replicas still renders (as an empty bar).
    """
    dimensions = (
        ("slots", "Slots", "slots"),
        ("tokens_per_second", "Tokens / s", "tok/s"),
        ("kv_bytes", "KV cache", "bytes"),
    )
    return [
        UsageBar(
            key=key,
            label=label,
            reserved=float(reserved.get(key, 0) or 0),
            capacity=float(capacity.get(key, 0) or 0),
            unit=unit,
        )
        for key, label, unit in dimensions
    ]
