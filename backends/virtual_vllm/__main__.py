"""`python -m backends.virtual_vllm --port 8100 ...`: serve the virtual vLLM (flags in `cli`)."""

from __future__ import annotations

from backends.virtual_vllm.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
