"""Where `apply -f` reads manifests: files, directories (``-R`` to descend) and standard input (``-``), each
file parsed on its own within the limits of ``apps.pools.manifests.limits``; then the documents of all files
merged into one manifest, as ``kubectl apply -f DIR`` does.

A document repeated identically (same parsed content) in several places counts once: a GitOps repository
may declare a shared tenant in each file that needs it. Two different documents for one object (same kind
and ``metadata.name``) are a conflict, reported with both places, and nothing is applied.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apps.pools.manifests.limits import max_bytes, short
from apps.pools.manifests.reader import ManifestError, manifests_parse

EXTENSIONS = (".yaml", ".yml", ".json")
STDIN = "-"


class SourceError(Exception):
    """A manifest source cannot be read, parsed or merged; ``problems`` are whole lines naming the place."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Merged:
    documents: list[Any]
    origins: list[str]  # per document: "FILE, document N", so errors point into the right file


def expand(paths: list[str], *, recursive: bool = False) -> list[str]:
    """The files that ``paths`` name: a directory gives its manifest files (by extension, sorted by path),
    those of its subdirectories too when ``recursive``; ``-`` (standard input) may be named once."""
    files: list[str] = []
    for path in paths:
        if path == STDIN:
            if STDIN in files:
                raise SourceError(["- (standard input) is named more than once"])
            files.append(path)
            continue
        if not Path(path).is_dir():
            files.append(path)  # a missing file is reported when read, with the system's reason
            continue
        found = sorted(p for p in (Path(path).rglob("*") if recursive else Path(path).iterdir())
                       if p.is_file() and p.name.endswith(EXTENSIONS))
        if not found:
            hint = "" if recursive else " (-R descends into subdirectories)"
            raise SourceError([f"{path}: no {', '.join(EXTENSIONS)} files in this directory{hint}"])
        files.extend(str(p) for p in found)
    # One file named twice (a directory and a file in it) is read once.
    return list(dict.fromkeys(files))


def read_text(filename: str) -> str:
    """The file's text, read no further than one byte past the limit (a huge file is refused, not loaded)."""
    limit = max_bytes()
    try:
        if filename == STDIN:  # a text stream without a buffer (a test's StringIO) is read as text
            stdin = getattr(sys.stdin, "buffer", None)
            raw = stdin.read(limit + 1) if stdin is not None else sys.stdin.read(limit + 1).encode()
        else:
            with open(filename, "rb") as handle:
                raw = handle.read(limit + 1)
    except OSError as exc:
        raise SourceError([f"cannot read {filename}: {exc.strerror}"]) from exc
    if len(raw) > limit:
        raise SourceError([f"{filename}: larger than the limit of {limit} bytes (MANIFEST_MAX_BYTES)"])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceError([f"{filename}: not UTF-8 text"]) from exc


def parse_file(filename: str) -> list[Any]:
    """One file's documents (YAML, or JSON, which YAML reads: an object, or an array of documents)."""
    try:
        documents = manifests_parse(read_text(filename))
    except ManifestError as exc:
        raise SourceError([f"{filename}: {issue}" for issue in exc.issues]) from exc
    if len(documents) == 1 and isinstance(documents[0], list):
        return documents[0]
    return documents


def _identity(document: Any) -> tuple[str, str] | None:
    """(kind, name) of a document that has both; others are left for validation to report."""
    if not isinstance(document, Mapping):
        return None
    kind, metadata = document.get("kind"), document.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    return (kind, name) if isinstance(kind, str) and isinstance(name, str) and kind and name else None


def merge(files: list[tuple[str, list[Any]]]) -> Merged:
    """All files' documents as one manifest: identical repeats dropped, conflicting ones refused."""
    documents: list[Any] = []
    origins: list[str] = []
    first: dict[tuple[str, str], int] = {}  # (kind, name) -> its position in `documents`
    conflicts: list[str] = []
    for filename, parsed in files:
        for index, document in enumerate(parsed):
            where = f"{'(standard input)' if filename == STDIN else filename}, document {index}"
            key = _identity(document)
            if key is not None and key in first:
                seen = first[key]
                if documents[seen] != document:
                    conflicts.append(f"{key[0]} {short(key[1])!r} is declared differently in {origins[seen]} and "
                                     f"in {where}")
                continue
            if key is not None:
                first[key] = len(documents)
            documents.append(document)
            origins.append(where)
    if conflicts:
        raise SourceError(conflicts)
    return Merged(documents, origins)


def read_sources(paths: list[str], *, recursive: bool = False) -> Merged:
    """Expand, read, parse and merge; every file's problems are reported together."""
    parsed: list[tuple[str, list[Any]]] = []
    problems: list[str] = []
    for filename in expand(paths, recursive=recursive):
        try:
            parsed.append((filename, parse_file(filename)))
        except SourceError as exc:
            problems.extend(exc.problems)
    if problems:
        raise SourceError(problems)
    return merge(parsed)


def describe_issues(issues: Any, origins: Any) -> list[str]:
    """A manifest error's problems, one line each, naming the file and document each comes from."""
    lines = []
    for issue in issues:
        where = origins[issue.index] if issue.index is not None else "manifest"
        what = f" ({issue.kind} {issue.name!r})" if issue.kind else ""
        lines.append(f"{where}{what}: {issue.field + ': ' if issue.field else ''}{issue.message}")
    return lines
