"""Gemma 4: config -> ModelSpec, our paged text decoder, transformers' vision tower, weights,
tokenizer and the prompt layout the server feeds the model."""

from mmserve.model.loader import load_model
from mmserve.model.serving_model import Gemma4ServingModel
from mmserve.model.spec import ModelSpec, UnsupportedModelError, load_spec

__all__ = ["Gemma4ServingModel", "ModelSpec", "UnsupportedModelError", "load_model", "load_spec"]
