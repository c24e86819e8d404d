"""Another commit of this repository checked out beside this one, to measure both in one run ("no worse than
before" is a ratio taken on the same machine at the same time, not against a figure from another day)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def short_commit(ref: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", ref], capture_output=True, text=True,
                          check=True).stdout.strip()


@contextlib.contextmanager
def source_tree(ref: str) -> Iterator[Path]:
    """A detached worktree of `ref` in a temporary folder (removed afterwards). Its code runs with this
    checkout's virtual environment: a process started with the tree as its working directory imports the
    tree's packages first."""
    parent = Path(tempfile.mkdtemp(prefix="tokenpools-baseline-"))
    tree = parent / short_commit(ref)
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(tree), ref], check=True)
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False,
                       capture_output=True)
        shutil.rmtree(parent, ignore_errors=True)
