"""Tiny random Gemma 4 checkpoints, built once per test session (see gemma4_fixtures.py)."""

from __future__ import annotations

import pytest
from gemma4_fixtures import make_checkpoint


@pytest.fixture(scope="session", params=["per_layer", "flat"])
def checkpoint(request, tmp_path_factory):
    """(path, transformers reference model) for both config spellings of the same weights."""
    path = tmp_path_factory.mktemp(f"gemma4_{request.param}")
    hf = make_checkpoint(path, form=request.param, seed=1)
    return path, hf


@pytest.fixture(scope="session")
def loaded(checkpoint):
    from mmserve.model import load_model

    path, hf = checkpoint
    return load_model(path, dtype="float32", device="cpu", attention_backend="reference"), hf
