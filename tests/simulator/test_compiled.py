"""The opt-in mypyc build of the simulator's hot path (`apps.compiled`) is never used stale, partial or mixed.

(That it gives the pure Python's results is `make conformance-compiled`: the conformance suite and the
pre-change pins of tests/simulator/test_speed_pins.py run on it.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from apps import compiled


def _manifest(build: Path, *, python: str | None = None, stale: str = "") -> None:
    modules = {module: {"file": f"{module}.so", "sha256": "0" * 64 if module == stale else compiled.source_hash(module)}
               for module in compiled.MODULES}
    build.mkdir(exist_ok=True)
    (build / compiled.MANIFEST).write_text(json.dumps({"python": python or sys.implementation.cache_tag,
                                                       "modules": modules}))


def test_a_missing_build_is_refused_with_the_command_that_makes_it(tmp_path: Path) -> None:
    with pytest.raises(ImportError, match="make compile-sim"):
        compiled.compiled_modules(tmp_path)


def test_a_build_whose_source_changed_since_is_refused_naming_the_module(tmp_path: Path) -> None:
    _manifest(tmp_path, stale="apps.policy.ledger")
    with pytest.raises(ImportError, match=r"apps\.policy\.ledger is stale"):
        compiled.compiled_modules(tmp_path)


def test_a_build_for_another_python_is_refused(tmp_path: Path) -> None:
    _manifest(tmp_path, python="cpython-39")
    with pytest.raises(ImportError, match="cpython-39"):
        compiled.compiled_modules(tmp_path)


def test_a_current_build_maps_every_module_to_its_extension(tmp_path: Path) -> None:
    _manifest(tmp_path)
    found = compiled.compiled_modules(tmp_path)
    assert set(found) == set(compiled.MODULES)
    assert found["apps.policy.ledger"] == tmp_path / "apps.policy.ledger.so"


@pytest.mark.skipif(compiled.active(), reason="this process runs the compiled build")
def test_compiled_and_python_modules_never_mix(tmp_path: Path) -> None:
    _manifest(tmp_path)
    import apps.policy.ledger  # noqa: F401  (imported as Python, as in every test process)

    with pytest.raises(ImportError, match="already imported as Python"):
        compiled.install(tmp_path)
    assert not compiled.active()


@pytest.mark.skipif(not compiled.active(), reason="runs on the compiled build (TOKENPOOLS_COMPILED=1)")
def test_the_hot_value_objects_are_built_by_compiled_code() -> None:
    # An __init__ that dataclasses generates, or a NamedTuple's __new__, is Python code even in a compiled module
    # (issue 26, item 5: about a sixth of the compiled simulator's time went to them); the hot path's own are not.
    from types import FunctionType

    from apps.policy.admission import AdmissionRequest
    from apps.policy.classes import ResourceVector
    from apps.policy.ledger import LedgerResult, ReleaseResult, WakeResult
    from apps.policy.priority import Dynamics
    from apps.policy.window import WindowFigures, WindowReading
    from apps.simulator.cluster import GateDecision

    hot = (AdmissionRequest, LedgerResult, ReleaseResult, WakeResult, ResourceVector, Dynamics, WindowFigures,
           WindowReading, GateDecision)
    assert [cls.__name__ for cls in hot if isinstance(cls.__dict__["__init__"], FunctionType)] == []
