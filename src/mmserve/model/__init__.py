"""Gemma 4: config -> ModelSpec, our paged text decoder, transformers' vision tower, weights,
tokenizer and the prompt layout the server feeds the model.

The names below load on first use: the front end imports `mmserve.model.messages` / `.prompt` /
`.spec`, and an eager import here would pull transformers' vision tower into it (seconds per start)."""

from __future__ import annotations

import importlib

_HOMES = {
    "load_model": "mmserve.model.loader",
    "Gemma4ServingModel": "mmserve.model.serving_model",
    "ModelSpec": "mmserve.model.spec",
    "UnsupportedModelError": "mmserve.model.spec",
    "load_spec": "mmserve.model.spec",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'mmserve.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
