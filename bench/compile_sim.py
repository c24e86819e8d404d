"""Compile the simulator's hot path with mypyc into build/compiled/ (issue 26, item 5; `make compile-sim`).

The modules of `apps.compiled.MODULES`, unchanged, are compiled in a scratch copy of the tree (so no extension
lands beside its source, where it would shadow it), and their extensions copied to build/compiled/ with a
manifest of the sources' hashes. `TOKENPOOLS_COMPILED=1` then loads them (`apps.compiled.install`).

    python -m bench.compile_sim
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from apps.compiled import BUILD_DIR, MANIFEST, MODULES, ROOT, source_hash

# mypyc type-checks what it compiles; the project's mypy settings load the Django plugins, which need a configured
# Django. The compiled modules import neither Django nor DRF (the policy core is framework-free).
MYPY_CONFIG = "[mypy]\npython_version = 3.11\nignore_missing_imports = True\n"


def build(out: Path = BUILD_DIR) -> dict[str, str]:
    with tempfile.TemporaryDirectory(prefix="compile-sim-") as tmp:
        scratch = Path(tmp)
        for package in ("apps", "backends"):
            shutil.copytree(ROOT / package, scratch / package,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so", "migrations", "templates", "static"))
        (scratch / "mypy.ini").write_text(MYPY_CONFIG)
        paths = [str(Path(*module.split(".")).with_suffix(".py")) for module in MODULES]
        subprocess.run([sys.executable, "-m", "mypyc", "--config-file", "mypy.ini", *paths], cwd=scratch,
                       check=True, stdout=subprocess.DEVNULL)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        files: dict[str, dict[str, str]] = {}
        for module in MODULES:
            parts = module.split(".")
            built = sorted(scratch.joinpath(*parts[:-1]).glob(f"{parts[-1]}.*.so"))
            if len(built) != 1:
                raise SystemExit(f"compile_sim: no extension built for {module}")
            target = out.joinpath(*parts[:-1], built[0].name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(built[0], target)
            files[module] = {"file": str(target.relative_to(out)), "sha256": source_hash(module)}
        for runtime in scratch.glob("*__mypyc.*.so"):  # the build's shared runtime, a top-level module
            shutil.copy2(runtime, out / runtime.name)
    (out / MANIFEST).write_text(json.dumps({"python": sys.implementation.cache_tag, "modules": files}, indent=1))
    return {module: entry["file"] for module, entry in files.items()}


def main() -> int:
    built = build()
    print(f"compiled {len(built)} modules into {BUILD_DIR.relative_to(ROOT)}; use them with TOKENPOOLS_COMPILED=1")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
