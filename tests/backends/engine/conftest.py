from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly generated random-weight Llama folder (about two seconds; shared by the session)."""
    from backends.engine.tiny_model import TinyModelSpec, generate_tiny_model

    return generate_tiny_model(tmp_path_factory.mktemp("models") / "tiny", TinyModelSpec(seed=7))


@pytest.fixture(autouse=True)
def _denormals_restored() -> Iterator[None]:
    """The runner flushes denormals to zero for speed, a process-wide CPU flag: give the flag back, or tests
    that run after these in the same process (hypothesis' float strategies) see a broken IEEE-754."""
    import torch

    yield
    torch.set_flush_denormal(False)
