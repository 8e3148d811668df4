"""A tiny random Gemma 4 checkpoint (the model tests' fixture builder) loaded once per backend."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))   # gemma4_fixtures lives with the model tests
sys.path.insert(0, str(Path(__file__).parents[1] / "scheduler"))   # sched_helpers


@pytest.fixture(scope="session")
def engine_checkpoint(tmp_path_factory):
    """(path, transformers reference model)."""
    from gemma4_fixtures import make_checkpoint

    path = tmp_path_factory.mktemp("engine_gemma4")
    hf = make_checkpoint(path, seed=21)
    return path, hf


_models: dict[str, object] = {}


@pytest.fixture(scope="session")
def load_backend(engine_checkpoint):
    """load_backend(name) -> (model, tokenizer), cached for the session."""
    from mmserve.model import load_model
    from mmserve.model.tokenizer import load_tokenizer

    path, _ = engine_checkpoint

    def load(name: str):
        if name not in _models:
            _models[name] = load_model(path, dtype="float32", device="cpu", attention_backend=name)
        return _models[name], load_tokenizer(path)

    return load
