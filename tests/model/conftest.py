"""Tiny random Gemma 4 checkpoints, built once per test session (see gemma4_fixtures.py)."""

from __future__ import annotations

import shutil

import pytest
from gemma4_fixtures import make_checkpoint, to_flat_form


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{"per_layer": path, "flat": path} holding the same weights, plus the transformers reference model."""
    root = tmp_path_factory.mktemp("gemma4")
    hf = make_checkpoint(root / "per_layer", form="per_layer", seed=1)
    shutil.copytree(root / "per_layer", root / "flat")
    to_flat_form(root / "flat" / "config.json")
    return {"per_layer": root / "per_layer", "flat": root / "flat"}, hf


def _load(path):
    from mmserve.model import load_model

    return load_model(path, dtype="float32", device="cpu", attention_backend="reference")


@pytest.fixture(scope="session", params=["per_layer", "flat"])
def loaded(request, checkpoints):
    """(our model, transformers model) for both config spellings of the same weights."""
    paths, hf = checkpoints
    return _load(paths[request.param]), hf


@pytest.fixture(scope="session")
def loaded_hub(checkpoints):
    """(our model from the hub's flat config form, transformers model)."""
    paths, hf = checkpoints
    return _load(paths["flat"]), hf
