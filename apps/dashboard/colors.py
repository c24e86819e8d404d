"""One colour per entitlement on every page (issue 28).

The colour is a function of the entitlement's name alone (a checksum into a fixed palette), so the pool's
live page, the entitlement's own page, the usage page and the overview draw it alike without knowing what
else is on the page. Twenty-four colours keep two names of a pool apart most of the time; when two do
collide, their legend names (and dash styles) still tell them apart.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

# Plotly's "Dark24" qualitative palette: dark enough to read on white, distinct from the pool's grey.
PALETTE: tuple[str, ...] = (
    "#2E91E5", "#E15F99", "#1CA71C", "#FB0D0D", "#DA16FF", "#7F3C8D", "#B68100", "#750D86",
    "#EB663B", "#511CFB", "#00A08B", "#FB00D1", "#FC0080", "#B2828D", "#6C7C32", "#778AAE",
    "#862A16", "#A777F1", "#620042", "#1616A7", "#DA60CA", "#6C4516", "#0D2A63", "#AF0038",
)


def entitlement_color(name: str) -> str:
    """The entitlement's colour: the same on every page, every reload and every process (crc32, not
    Python's salted `hash`)."""
    return PALETTE[zlib.crc32(name.encode()) % len(PALETTE)]


def entitlement_colors(names: Iterable[str]) -> dict[str, str]:
    return {name: entitlement_color(name) for name in names}
