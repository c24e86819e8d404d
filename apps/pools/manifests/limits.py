"""Bounds on manifest input, so that what a member sends cannot cost the server more than its own size.

A manifest is refused (a ``ManifestError`` naming the document) when it is larger than
``settings.MANIFEST_MAX_BYTES``, nests deeper than ``MAX_DEPTH``, holds more than ``MAX_NODES`` values, or
uses a YAML alias (``*name``): aliases are refused while the YAML is composed, before anything is expanded
(a 400-byte "billion laughs" document otherwise expands to hundreds of millions of values). Error messages
quote values through ``excerpt``: at most ``EXCERPT_CHARS`` characters of them.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from typing import Any

import yaml
from django.conf import settings
from yaml.nodes import Node

# Our own manifests nest 5 deep (spec.backend.replicas[0].url); labels and annotations a little deeper.
MAX_DEPTH = 32
# Far above any real manifest (one document is ~40 values), far below what a 1 MiB body can expand to.
MAX_NODES = 200_000
EXCERPT_CHARS = 80
# At most this many problems are listed; the rest are counted.
MAX_ISSUES = 100

class _ShortRepr(reprlib.Repr):
    """reprlib's bounded repr: a few items of each container, the start of each string."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxdict, self.maxtuple, self.maxset = 3, 4, 4, 4, 4
        # A lone string fits whole in an excerpt: its quotes and the ellipsis included.
        self.maxstring, self.maxother, self.maxlong = EXCERPT_CHARS - 3, EXCERPT_CHARS, EXCERPT_CHARS

    def repr_str(self, x: str, level: int) -> str:
        # The start of the text and an ellipsis (reprlib's own keeps both ends, joined by "...").
        return repr(x) if len(x) <= self.maxstring else repr(x[: self.maxstring])[:-1] + "…'"

    def repr_int(self, x: int, level: int) -> str:
        # repr() of an int past 4,300 digits raises ValueError (CPython's limit); say its size instead.
        return f"<an integer of {x.bit_length()} bits>" if x.bit_length() > 256 else super().repr_int(x, level)


_repr = _ShortRepr()


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters (with an ellipsis), without ever building the whole repr."""
    text = _repr.repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def short(text: str, limit: int = EXCERPT_CHARS) -> str:
    """A name or kind as written, cut to ``limit`` characters (with an ellipsis)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def max_bytes() -> int:
    return int(settings.MANIFEST_MAX_BYTES)


def too_large(size: int) -> str | None:
    """Why a manifest of ``size`` bytes is refused, or None."""
    limit = max_bytes()
    if size <= limit:
        return None
    return f"the manifest is {size} bytes; the limit is {limit} bytes (MANIFEST_MAX_BYTES)"


class ManifestLimitError(yaml.YAMLError):
    """A bound crossed while composing YAML; ``index`` is the document's position in the stream."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index
        self.message = message


class ManifestLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses aliases and bounds depth and node count while composing, i.e. before
    any value is constructed (the composer is where an alias would share a node many times over)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._document = -1
        self._depth = 0
        self._nodes = 0

    def compose_document(self) -> Node | None:
        self._document += 1
        self._depth = 0
        return super().compose_document()

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ManifestLimitError(self._document, f"YAML aliases (*{short(event.anchor, 40)}) are not "
                                     f"accepted in manifests: write the value out ({_where(event)})")
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise ManifestLimitError(self._document, f"more than {MAX_NODES} values in the manifest "
                                     f"({_where(self.peek_event())})")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise ManifestLimitError(self._document, f"nested deeper than {MAX_DEPTH} levels "
                                         f"({_where(self.peek_event())})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _where(event: Any) -> str:
    mark = event.start_mark
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _load_all_python(text: str) -> list[Any]:
    loader = ManifestLoader(text)
    try:
        documents = []
        while loader.check_data():
            documents.append(loader.get_data())
        return documents
    finally:
        loader.dispose()


# What each libyaml event is to the checks: 0 a scalar, 1 a collection opening, -1 one closing, 2 a document
# starting, 3 an alias; other events are not counted.
_EVENT_ROLE: dict[type, int] = {yaml.ScalarEvent: 0, yaml.SequenceStartEvent: 1, yaml.MappingStartEvent: 1,
                                yaml.SequenceEndEvent: -1, yaml.MappingEndEvent: -1, yaml.DocumentStartEvent: 2,
                                yaml.AliasEvent: 3}


def _check_events(text: str) -> None:
    """``ManifestLoader``'s checks on libyaml's event stream, in the same order with the same messages: an alias,
    the node count, the depth (raises ``ManifestLimitError``; a malformed stream raises yaml's own error)."""
    document, depth, nodes = -1, 0, 0
    roles = _EVENT_ROLE
    for event in yaml.parse(text, Loader=yaml.CSafeLoader):
        role = roles.get(type(event))
        if role is None:
            continue
        if role == -1:
            depth -= 1
        elif role <= 1:  # a node: a scalar or a collection
            nodes += 1
            if nodes > MAX_NODES:
                raise ManifestLimitError(document, f"more than {MAX_NODES} values in the manifest ({_where(event)})")
            if depth >= MAX_DEPTH:
                raise ManifestLimitError(document, f"nested deeper than {MAX_DEPTH} levels ({_where(event)})")
            depth += role
        elif role == 2:
            document, depth = document + 1, 0
        else:
            anchor = str(getattr(event, "anchor", ""))  # an AliasEvent's
            raise ManifestLimitError(document, f"YAML aliases (*{short(anchor, 40)}) are not "
                                     f"accepted in manifests: write the value out ({_where(event)})")


def load_all(text: str) -> list[Any]:
    """All documents of ``text`` (raises ``yaml.YAMLError``), bounded as ``ManifestLoader`` bounds them.

    With libyaml (PyYAML's C extension) the bounds are checked on its event stream first, then its loader builds
    the documents, which no longer hold an alias: ten times faster than the pure-Python loader (a manifest of
    thousands of entitlements); without it, or for text libyaml refuses, ``ManifestLoader`` and its errors."""
    if not getattr(yaml, "__with_libyaml__", False):
        return _load_all_python(text)
    try:
        _check_events(text)
        return list(yaml.load_all(text, Loader=yaml.CSafeLoader))
    except ManifestLimitError:
        raise
    except yaml.YAMLError:  # malformed (or past libyaml's own bounds): the pure-Python loader's error, as before
        return _load_all_python(text)


def structure_problem(documents: list[Any]) -> tuple[int, str] | None:
    """(document index, why) for documents given as data (a JSON body) that cross the depth or node bounds."""
    for index, document in enumerate(documents):
        # Per document: the documents of several files (each bounded by the loader and MANIFEST_MAX_BYTES) make
        # one manifest of thousands of entitlements; a body's total is bounded by its size (JSON has no aliases).
        nodes = 0
        stack: list[tuple[Any, int]] = [(document, 1)]
        while stack:  # iterative: a deep document must not exhaust Python's recursion limit here either
            node, depth = stack.pop()
            nodes += 1
            if nodes > MAX_NODES:
                return index, f"more than {MAX_NODES} values in one document"
            if depth > MAX_DEPTH:
                return index, f"nested deeper than {MAX_DEPTH} levels"
            children = node.values() if isinstance(node, Mapping) else node if isinstance(node, list) else ()
            stack.extend((child, depth + 1) for child in children)
    return None
