"""`load_model(path, ...)`: config -> spec -> modules on the meta device -> checkpoint tensors."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import torch

from mmserve.config import default_dtype
from mmserve.model.audio import AudioEncoder
from mmserve.model.decoder import TextDecoder
from mmserve.model.parallel import SINGLE, ParallelGroup, local_spec
from mmserve.model.serving_model import Gemma4ServingModel
from mmserve.model.spec import ModelSpec, load_spec
from mmserve.model.vision import VisionEncoder
from mmserve.model.vision_embedder import UnifiedVisionEncoder
from mmserve.model.weights import load_weights

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """A torch dtype from a --dtype value; "auto" depends on `device` (config.default_dtype)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = default_dtype(str(device))
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of auto, float32, bfloat16, float16")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _consumer_kv_weights(spec: ModelSpec) -> re.Pattern | None:
    """KV-sharing layers' K/V projections and norms, which some checkpoints still ship (E2B's does;
    transformers ignores them, and copies it saves drop them): accepted and skipped."""
    consumers = [str(layer.index) for layer in spec.layers if layer.shares_kv]
    if not consumers:
        return None
    return re.compile(rf"^decoder\.layers\.({'|'.join(consumers)})\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


def load_model(path: str | Path, *, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               attention_backend: str = "reference", parallel: ParallelGroup = SINGLE) -> Gemma4ServingModel:
    """Load a Gemma 4 checkpoint directory for serving. `attention_backend` may be "auto"; each layer
    type's backend is `model.attention_backends[layer_type]` (the runner builds that backend's metadata):
    FA4 where it runs the layer type, the batched fallback elsewhere (attention/selection.py).
    With a `parallel` group of size N this rank loads only its shard of the decoder (the vision
    and audio towers are replicated); `model.spec` then carries this rank's attention heads, which size its KV
    pools and kernels."""
    from mmserve.attention import create_impl, resolve_backend
    from mmserve.attention.fa4 import fa4_installed
    from mmserve.attention.selection import choose_backends, device_arch

    start = time.perf_counter()
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    full_spec = load_spec(path)
    spec = local_spec(full_spec, parallel)   # refuses sizes that do not divide, naming the dimension
    backends = choose_backends(spec.attention_specs, device_type=torch_device.type, arch=device_arch(torch_device),
                               dtype=torch_dtype, fa4_installed=fa4_installed(),
                               requested=resolve_backend(attention_backend, torch_device))
    impls = {t: create_impl(backends[t], s) for t, s in spec.attention_specs.items()}
    # The decoder is built without storage; the checkpoint's tensors are assigned into it.
    with torch.device("meta"):
        decoder = TextDecoder(full_spec, impls, parallel)
    vision = None
    if spec.vision is not None and spec.vision.kind == "embedder":
        with torch.device("meta"):
            vision = UnifiedVisionEncoder(spec.hf_config)
    elif spec.vision is not None:
        with torch.device(torch_device):
            vision = VisionEncoder(spec.hf_config)
    audio = None
    if spec.audio is not None:
        with torch.device(torch_device):
            audio = AudioEncoder(spec.hf_config)
    model = Gemma4ServingModel(spec, decoder, vision, backends, parallel, audio=audio)
    model.bytes_read = load_weights(model, path, dtype=torch_dtype, device=torch_device,
                                    tied=spec.tie_word_embeddings, ignore=_consumer_kv_weights(spec))
    model.eval()
    consumers = spec.num_layers - len(spec.kv_layer_types)
    logger.info("loaded %s (%s)%s: %d layers%s%s%s %s, %s on %s, %s attention in %.1fs", path, spec.model_type,
                f", tensor-parallel rank {parallel.rank} of {parallel.size}" if parallel.size > 1 else "",
                spec.num_layers, f", {consumers} sharing KV (no cache)" if consumers else "",
                ", per-layer embeddings" if spec.ple else "",
                f", {spec.layers[0].moe.num_experts} experts top-{spec.layers[0].moe.top_k}" if spec.layers[0].moe else "",
                ("+vision" if vision else "text-only") + ("+audio" if audio else ""), torch_dtype, torch_device, backends,
                time.perf_counter() - start)
    return model
