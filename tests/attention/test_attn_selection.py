"""--attention-backend values map onto implementations; auto never picks a backend this machine lacks."""

from __future__ import annotations

import pytest
import torch
from attn_batches import SLIDING_SPEC

from mmserve.attention import (
    CPU_AUTO_BACKEND,
    PoolConfig,
    available_backends,
    create_builder,
    create_impl,
    get_backend,
    resolve_backend,
)


def test_auto_on_cpu_is_the_measured_cpu_backend():
    assert resolve_backend("auto", "cpu") == CPU_AUTO_BACKEND
    assert CPU_AUTO_BACKEND in available_backends()


@pytest.mark.parametrize("name", ["reference", "sdpa", "flex"])
def test_named_backends_resolve_to_themselves_and_build(name):
    assert resolve_backend(name, "cpu") == name
    assert create_impl(name, SLIDING_SPEC).spec == SLIDING_SPEC


def test_unknown_backend_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="sdpa"):
        resolve_backend("flash2", "cpu")
    with pytest.raises(ValueError, match="reference"):
        create_impl("auto", SLIDING_SPEC)


def test_fa4_is_never_built_for_a_layer_type_it_cannot_run():
    """The loader gives such layer types the fallback (selection.choose_backends); the builder refuses them."""
    pool = PoolConfig(SLIDING_SPEC, num_blocks=8, block_size=16, max_num_tokens=32, max_num_reqs=2,
                      max_blocks_per_req=4, device=torch.device("cpu"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="batched fallback"):
        create_builder("fa4", pool)
    from mmserve.config import DEMO_MODEL_DIR
    from mmserve.model import load_model

    model = load_model(DEMO_MODEL_DIR, attention_backend="fa4")
    assert set(model.attention_backends.values()) == {CPU_AUTO_BACKEND}   # no GPU here: every type falls back
    assert model.attention_backend == CPU_AUTO_BACKEND


@pytest.mark.parametrize("name", ["reference", "sdpa", "flex", "fa4"])
def test_every_backend_is_a_bundle_of_impl_builder_and_cache_shape(name):
    backend = get_backend(name)
    assert backend.name == name
    assert backend.impl_cls(SLIDING_SPEC).spec == SLIDING_SPEC
    assert backend.kv_cache_shape(10, 16, SLIDING_SPEC) == (2, 10, 16, SLIDING_SPEC.num_kv_heads, SLIDING_SPEC.head_dim)
