# Opt-in: the simulator's hot path compiled with mypyc (apps/compiled.py; `make compile-sim`). Unset: pure Python.
import os as _os

if _os.environ.get("TOKENPOOLS_COMPILED"):
    from apps.compiled import install as _install

    _install()
