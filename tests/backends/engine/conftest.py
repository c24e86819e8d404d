from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly generated random-weight Llama folder (about two seconds; shared by the session)."""
    from backends.engine.tiny_model import TinyModelSpec, generate_tiny_model

    return generate_tiny_model(tmp_path_factory.mktemp("models") / "tiny", TinyModelSpec(seed=7))
