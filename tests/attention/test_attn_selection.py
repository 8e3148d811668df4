"""--attention-backend values map onto implementations; auto never picks a backend this machine lacks."""

from __future__ import annotations

import pytest
import torch
from attn_batches import SLIDING_SPEC

from mmserve.attention import CPU_AUTO_BACKEND, available_backends, create_impl, resolve_backend


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback of the fa4 backend")
def test_fa4_without_a_gpu_falls_back_per_layer_type():
    impl = create_impl("fa4", SLIDING_SPEC)
    assert not impl.use_fa4
