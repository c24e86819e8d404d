"""The simulator's hot path compiled with mypyc (issue 26, item 5), used only when asked for.

`make compile-sim` (`python -m bench.compile_sim`) compiles the modules below, unchanged, into `build/compiled/`
with a manifest of their sources' hashes. With `TOKENPOOLS_COMPILED=1` in the environment, `apps/__init__.py`
calls `install()` before any of them is imported, and they load from there; without it (the default) nothing
here runs and every module is the pure Python one. The two give the same results: `make conformance-compiled`
runs the conformance suite and the pre-change pins (tests/simulator/test_speed_pins.py) on the compiled build.

A build whose sources have changed since it was compiled is refused (ImportError naming the module), so a stale
extension can never shadow an edited module. Only stdlib imports here: this runs before anything else.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

ENV_VAR = "TOKENPOOLS_COMPILED"
ROOT = Path(__file__).resolve().parent.parent
BUILD_DIR = ROOT / "build" / "compiled"
MANIFEST = "manifest.json"
# The decision path of a simulated request: the policy core, the simulator's loop, cluster, workload and adapters
# (replay's subclasses of them included: a compiled class cannot be subclassed by an interpreted one), and the
# virtual vLLM instance. All of them or none: compiled code expects the compiled classes of the others.
MODULES: tuple[str, ...] = (
    "apps.policy.admission",
    "apps.policy.bucket",
    "apps.policy.classes",
    "apps.policy.ledger",
    "apps.policy.ledger_records",
    "apps.policy.priority",
    "apps.policy.queues",
    "apps.policy.quota",
    "apps.policy.quota_offer",
    "apps.policy.tiers",
    "apps.policy.window",
    "apps.simulator.admission",
    "apps.simulator.cluster",
    "apps.simulator.engine",
    "apps.simulator.replay",
    "apps.simulator.workload",
    "backends.virtual_vllm.instance",
    "backends.virtual_vllm.latency",
)


def source_path(module: str) -> Path:
    return ROOT.joinpath(*module.split(".")).with_suffix(".py")


def source_hash(module: str) -> str:
    return hashlib.sha256(source_path(module).read_bytes()).hexdigest()


class CompiledFinder(importlib.abc.MetaPathFinder):
    """Finds the compiled extension of each module in `modules` (a name -> file mapping)."""

    def __init__(self, modules: dict[str, Path]) -> None:
        self.modules = modules

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        location = self.modules.get(fullname)
        if location is None:
            return None
        return importlib.util.spec_from_file_location(fullname, location)


def compiled_modules(build_dir: Path = BUILD_DIR) -> dict[str, Path]:
    """Each module's extension in `build_dir`; ImportError when the build is missing, partial or stale."""
    manifest_path = build_dir / MANIFEST
    if not manifest_path.is_file():
        raise ImportError(f"{ENV_VAR} is set but {build_dir} holds no compiled build: run `make compile-sim`")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("python") != sys.implementation.cache_tag:
        raise ImportError(f"the compiled build is for {manifest.get('python')}, this is "
                          f"{sys.implementation.cache_tag}: run `make compile-sim`")
    found: dict[str, Path] = {}
    for module in MODULES:
        entry = manifest.get("modules", {}).get(module)
        if entry is None or entry["sha256"] != source_hash(module):
            raise ImportError(f"the compiled build of {module} is stale (its source changed since): run "
                              f"`make compile-sim`, or unset {ENV_VAR}")
        found[module] = build_dir / entry["file"]
    return found


def install(build_dir: Path = BUILD_DIR) -> None:
    """Load MODULES from the compiled build from now on (before any of them is imported)."""
    if any(isinstance(finder, CompiledFinder) for finder in sys.meta_path):
        return
    loaded = [module for module in MODULES if module in sys.modules]
    if loaded:
        raise ImportError(f"{ENV_VAR}: {', '.join(loaded)} already imported as Python; compiled and Python "
                          "modules of the hot path cannot mix")
    modules = compiled_modules(build_dir)
    # mypyc's shared runtime of the build is a top-level module in build_dir.
    if str(build_dir) not in sys.path:
        sys.path.append(str(build_dir))
    sys.meta_path.insert(0, CompiledFinder(modules))


def active() -> bool:
    """Whether this process loads the compiled build."""
    return any(isinstance(finder, CompiledFinder) for finder in sys.meta_path)
