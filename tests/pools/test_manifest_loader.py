"""The fast manifest loader (libyaml's events checked, then its loader) reads what the pure-Python
`ManifestLoader` reads and refuses what it refuses, with the same message."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from django.conf import settings

from apps.pools.manifests.limits import MAX_DEPTH, ManifestLimitError, _load_all_python, load_all

EXAMPLES = sorted((Path(settings.BASE_DIR) / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_examples_load_the_same(path: Path) -> None:
    text = path.read_text()
    assert load_all(text) == _load_all_python(text)


def _nested(depth: int) -> str:
    return "a: " + "[" * depth + "]" * depth + "\n"


@pytest.mark.parametrize("text", [
    "kind: Tenant\n---\nx: &a [1, 2]\ny: *a\n",
    "kind: Tenant\n---\n" + _nested(MAX_DEPTH),
    "kind: Tenant\n---\n" + "\n".join(f"k{i}: [{', '.join(['1'] * 50)}]" for i in range(4100)),
])
def test_limits_are_refused_with_the_same_message(text: str) -> None:
    with pytest.raises(ManifestLimitError) as fast:
        load_all(text)
    with pytest.raises(ManifestLimitError) as slow:
        _load_all_python(text)
    assert (fast.value.index, fast.value.message) == (slow.value.index, slow.value.message)


def test_malformed_yaml_raises_the_pure_python_error() -> None:
    text = "a: [1, 2\nb: 3\n"
    with pytest.raises(yaml.YAMLError) as fast:
        load_all(text)
    with pytest.raises(yaml.YAMLError) as slow:
        _load_all_python(text)
    assert str(fast.value) == str(slow.value)


def test_values_yaml_types_build_the_same() -> None:
    text = "a: 2026-01-02T03:04:05Z\nb: 0.15\nc: yes\nd: ~\ne: '007'\nf: 1e3\n"
    assert load_all(text) == _load_all_python(text)
