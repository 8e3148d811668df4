"""`load_model(path, ...)`: config -> spec -> modules on the meta device -> checkpoint tensors."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from mmserve.model.decoder import TextDecoder
from mmserve.model.serving_model import Gemma4ServingModel
from mmserve.model.spec import ModelSpec, UnsupportedModelError, load_spec
from mmserve.model.vision import VisionEncoder
from mmserve.model.weights import load_weights

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of float32, bfloat16, float16")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _reject_unbuilt(spec: ModelSpec) -> None:
    if spec.ple is not None:
        raise UnsupportedModelError("per-layer embeddings (hidden_size_per_layer_input) are not supported yet")
    if any(layer.shares_kv for layer in spec.layers):
        raise UnsupportedModelError("KV sharing (num_kv_shared_layers) is not supported yet")
    if any(layer.moe for layer in spec.layers):
        raise UnsupportedModelError("mixture-of-experts (enable_moe_block) is not supported yet")
    if spec.model_type != "gemma4":
        raise UnsupportedModelError(f"model_type={spec.model_type!r} is not supported yet")


def load_model(path: str | Path, *, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               attention_backend: str = "reference", max_num_tokens: int = 512,
               max_num_reqs: int = 64) -> Gemma4ServingModel:
    """Load a Gemma 4 checkpoint directory for serving.

    `attention_backend` may be "auto"; `max_num_tokens` / `max_num_reqs` (the engine's step budget)
    size compiled backends so they compile once.
    """
    from mmserve.attention import create_impl, resolve_backend

    start = time.perf_counter()
    torch_dtype, torch_device = resolve_dtype(dtype), resolve_device(device)
    spec = load_spec(path)
    _reject_unbuilt(spec)
    attention_backend = resolve_backend(attention_backend, torch_device)
    impls = {t: create_impl(attention_backend, s, max_num_tokens=max_num_tokens, max_num_reqs=max_num_reqs)
             for t, s in spec.attention_specs.items()}
    # The decoder is built without storage; the checkpoint's tensors are assigned into it.
    with torch.device("meta"):
        decoder = TextDecoder(spec, impls)
    vision = None
    if spec.has_vision:
        with torch.device(torch_device):
            vision = VisionEncoder(spec.hf_config)
    model = Gemma4ServingModel(spec, decoder, vision)
    load_weights(model, path, dtype=torch_dtype, device=torch_device, tied=spec.tie_word_embeddings)
    model.eval()
    logger.info("loaded %s: %d layers %s, %s on %s, %s attention in %.1fs", path, spec.num_layers,
                "+vision" if vision else "text-only", torch_dtype, torch_device, attention_backend,
                time.perf_counter() - start)
    return model
