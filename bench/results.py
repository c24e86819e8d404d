"""Write one benchmark's section of bench/RESULTS.md, leaving the other sections as they are."""

from __future__ import annotations

import json
import platform
import re
import subprocess
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
OUT = Path(__file__).resolve().parent / "out"
HEADER = "# Benchmark results\n\nEach section is rewritten by the command it names; figures are as measured, not targets.\n"


def machine_description() -> str:
    """CPU model, core count and memory of this machine, for the record beside the figures."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        cores = subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        cores = "?"
    mem_gib = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = f"{int(line.split()[1]) / 1024 / 1024:.0f}"
                break
    except OSError:
        pass
    return f"{cpu}, {cores} cores, {mem_gib} GiB, Python {platform.python_version()}, {platform.system()}"


def write_section(title: str, body: str, path: Path = RESULTS) -> None:
    """Replace the `## title` section (up to the next `## `) or append it."""
    text = path.read_text() if path.exists() else HEADER
    section = f"## {title}\n\n{body.strip()}\n\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _m: section, text, count=1)
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text.rstrip() + "\n")


def write_rendered_section(section: str, path: Path = RESULTS) -> None:
    """`write_section` for a section rendered with its own `## title` as the first line."""
    heading, _, body = section.partition("\n")
    if not heading.startswith("## "):
        raise ValueError(f"a rendered section starts with its '## ' heading, got {heading!r}")
    write_section(heading[3:], body, path)


def save_rows(name: str, rows: Iterable[Any]) -> Path:
    """A benchmark's rows (dataclasses) as `bench/out/<name>.json`, for tools that read figures, not text."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps([asdict(row) for row in rows], indent=2))
    return path
