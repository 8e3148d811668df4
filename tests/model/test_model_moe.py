"""Experts: our router and dispatch against transformers' modules on the same weights, at most one
matmul per projection per distinct selected expert (counted on the real forward), and checkpoints
whose experts are stored packed or one tensor per expert load to the same weights."""

from __future__ import annotations

import random

import pytest
import torch
from gemma4_fixtures import e_model_config, make_checkpoint, moe_config
from safetensors.torch import load_file, save_file
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from mmserve.model import load_model
from mmserve.model import moe as moe_module
from mmserve.model.moe import Experts, MoeBlock, Router
from mmserve.model.spec import MoeSpec
from mmserve.model.weights import WeightLoadError

MATMULS = {"mm", "addmm", "bmm", "_grouped_mm"}


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.__name__.split(".")[0] in MATMULS
        return func(*args, **(kwargs or {}))


# Ops that read a device value on the host (or size their output from one) on CUDA. On a CPU
# each is legal and cheap, so the modes below make them fail instead.
SYNCING_OPS = {"_local_scalar_dense", "nonzero", "bincount", "masked_select", "_unique2", "unique_dim",
               "unique_consecutive", "repeat_interleave"}
HOST_READS = {"tolist", "numpy", "item", "__int__", "__bool__", "__float__", "__index__"}


class NoHostSync(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        boolean_index = name in ("index", "index_put") and any(
            i is not None and i.dtype == torch.bool for i in args[1])
        if name in SYNCING_OPS or boolean_index:
            raise AssertionError(f"host sync: aten.{name}")
        return func(*args, **(kwargs or {}))


class NoHostRead(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            raise AssertionError(f"host read: Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


def hf_modules(hidden: int, moe: MoeSpec):
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts, Gemma4TextRouter

    cfg = Gemma4TextConfig(hidden_size=hidden, num_experts=moe.num_experts, top_k_experts=moe.top_k,
                           moe_intermediate_size=moe.intermediate, enable_moe_block=True, num_hidden_layers=1,
                           layer_types=["full_attention"])
    cfg._experts_implementation = "eager"
    return Gemma4TextRouter(cfg), Gemma4TextExperts(cfg)


@pytest.mark.parametrize("tokens", [1, 16, 100])
def test_router_and_experts_match_transformers(tokens):
    rng = random.Random(random.getrandbits(64))
    hidden, moe = 24, MoeSpec(num_experts=rng.randint(4, 9), top_k=rng.randint(2, 3), intermediate=rng.randint(8, 20))
    hf_router, hf_experts = hf_modules(hidden, moe)
    router, experts = Router(hidden, moe, 1e-6), Experts(hidden, moe)
    with torch.no_grad():
        for module in (hf_router, hf_experts):
            for p in module.parameters():
                p.normal_(0, 0.3)
        router.load_state_dict(hf_router.state_dict())
        experts.load_state_dict(hf_experts.state_dict())
        x = torch.randn(tokens, hidden)
        _, ref_weights, ref_index = hf_router(x)
        weights, index = router(x)
        torch.testing.assert_close(index, ref_index, rtol=0, atol=0)
        torch.testing.assert_close(weights, ref_weights)
        with CountMatmuls() as counter:
            out = experts(x, weights, index)
        torch.testing.assert_close(out, hf_experts(x, ref_index, ref_weights), rtol=1e-5, atol=1e-6)
    distinct = len(set(index.flatten().tolist()))
    assert experts.touched == distinct
    assert counter.calls <= 2 * distinct   # gate_up and down, once per expert that has tokens


def test_grouped_gemm_path_equals_the_per_expert_loop():
    """The CUDA path (`torch._grouped_mm`, which this torch also runs on CPU) against the CPU loop,
    with experts that get no tokens in between."""
    moe = MoeSpec(num_experts=7, top_k=2, intermediate=16)
    experts = Experts(24, moe)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.3)
        experts.down_proj.normal_(0, 0.3)
        rows = torch.randn(11, 24)
        counts = torch.tensor([3, 0, 4, 0, 0, 2, 2])
        gate_up, down = experts.gate_up_proj, experts.down_proj
        torch.testing.assert_close(moe_module.grouped(rows, counts.cumsum(0), gate_up, down),
                                   moe_module.per_expert(rows, counts.tolist(), gate_up, down))


def per_expert_copy(packed_dir, dst, experts=None, keep_packed=False):
    """`packed_dir`'s checkpoint with the experts rewritten as one tensor per expert and matrix (gate /
    up / down): experts `experts` (default: all), each from its packed row (the last row past the end);
    `keep_packed`: the packed tensors too."""
    dst.mkdir()
    for f in packed_dir.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = {}
    for name, t in load_file(str(packed_dir / "model.safetensors")).items():
        stem = name.rsplit(".", 1)[0] + "."
        rows = range(t.shape[0]) if experts is None else experts
        if name.endswith("experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            for e in rows:
                tensors[f"{stem}{e}.gate_proj.weight"] = gate[min(e, len(gate) - 1)].clone()
                tensors[f"{stem}{e}.up_proj.weight"] = up[min(e, len(up) - 1)].clone()
        elif name.endswith("experts.down_proj"):
            for e in rows:
                tensors[f"{stem}{e}.down_proj.weight"] = t[min(e, len(t) - 1)].clone()
        if keep_packed or "experts." not in name:
            tensors[name] = t
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    make_checkpoint(path, config=moe_config(), seed=4)
    return path


def test_per_expert_checkpoint_and_shipped_consumer_kv_load(moe_checkpoint, tmp_path):
    packed = load_model(moe_checkpoint)
    ours = load_model(per_expert_copy(moe_checkpoint, tmp_path / "split"))
    for (name, a), (_, b) in zip(packed.state_dict().items(), ours.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)

    # E2B's official checkpoint still ships K/V projections for its KV-sharing layers: accepted, unused
    make_checkpoint(tmp_path / "e", config=e_model_config(), seed=5)
    weights = load_file(str(tmp_path / "e" / "model.safetensors"))
    weights["model.language_model.layers.4.self_attn.k_proj.weight"] = torch.zeros(32, 72)
    weights["model.language_model.layers.4.self_attn.k_norm.weight"] = torch.zeros(16)
    save_file(weights, str(tmp_path / "e" / "model.safetensors"))
    assert load_model(tmp_path / "e").decoder.layers[4].self_attn.projects_kv is False


def test_per_expert_ids_past_the_experts_are_unexpected(moe_checkpoint, tmp_path):
    """Experts 0-4 and 6 of 6: the count matched, then copying expert 6 raised a bare IndexError."""
    path = per_expert_copy(moe_checkpoint, tmp_path / "gap", experts=[0, 1, 2, 3, 4, 6])
    with pytest.raises(WeightLoadError, match=r"missing 12 .*gate_up_proj \(2 per-expert matrices\).*"
                                              r"unexpected 18 \['model.language_model.layers.0.experts.6.down_proj"):
        load_model(path)


def test_experts_given_both_packed_and_per_expert_are_refused(moe_checkpoint, tmp_path):
    """Which is meant is unknown: the packed tensors won silently before."""
    path = per_expert_copy(moe_checkpoint, tmp_path / "both", keep_packed=True)
    with pytest.raises(WeightLoadError, match=r"layers\.0\.experts\.(gate_up|down)_proj and the per-expert "
                                              r"model\.language_model\.layers\.0\.experts\.0\.\w+_proj\.weight both fill"):
        load_model(path)


def routed(block: MoeBlock, residual: torch.Tensor) -> torch.Tensor:
    r, e = block.router, block.experts
    return moe_module.routed_experts(residual, r.scale, r.proj.weight, r.per_expert_scale,
                                     block.pre_feedforward_layernorm_2.weight, e.gate_up_proj, e.down_proj, e.touched,
                                     r.norm.eps, r.top_k, e.first_expert, e.sharded)


@pytest.mark.parametrize("pairwise_max", [moe_module.PAIRWISE_MAX, 0])
def test_grouped_path_never_syncs_with_the_host(monkeypatch, pairwise_max):
    """The CUDA dispatch (forced here: CPU torch cannot make CUDA tensors, and this torch runs
    `_grouped_mm` on CPU) reads no device value on the host, so decode steps of 26B-A4B can be
    captured as CUDA graphs; the result and the touched count equal the per-expert loop's. Both
    ways of ranking the pairs: pairwise (decode) and by a scan (PAIRWISE_MAX 0: a prefill's)."""
    monkeypatch.setattr(moe_module, "PAIRWISE_MAX", pairwise_max)
    rng = random.Random(random.getrandbits(64))
    hidden, moe = 24, MoeSpec(num_experts=rng.randint(6, 9), top_k=2, intermediate=16)
    block = MoeBlock(hidden, moe, 1e-6)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
        residual = torch.randn(rng.randint(1, 20), hidden)
        reference = routed(block, residual)
        distinct = len(set(block.router(residual)[1].flatten().tolist()))
        block.experts.touched.zero_()
        monkeypatch.setattr(moe_module, "uses_grouped_mm", lambda x: True)
        with NoHostRead(), NoHostSync():
            out = routed(block, residual)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    assert int(block.experts.touched) == distinct


def test_pairwise_rank_equals_the_scan():
    """A pair's row in the grouped order, both ways, on fresh random buckets with many repeats (a
    sharded rank's other-rank bucket, the last, included): the same stable order."""
    rng = random.Random(random.getrandbits(64))
    buckets = rng.randint(2, 9)
    flat = torch.tensor([rng.randrange(buckets + 1) for _ in range(rng.randint(1, 200))])
    ids = torch.arange(buckets + 1)
    starts = (flat[:, None] < ids).sum(0)
    pairwise = moe_module.rank_pairwise(flat)
    assert torch.equal(pairwise, moe_module.rank_by_scan(flat, starts, ids))
    assert torch.equal(pairwise, torch.sort(flat, stable=True).indices.argsort())


def test_the_sync_detector_catches_the_reads_it_claims():
    counts = torch.tensor([0, 2, 1])
    for read in (lambda: int((counts > 0).sum()), lambda: (counts > 0).sum().item(), lambda: bool(counts[0]),
                 lambda: counts.tolist(), lambda: torch.bincount(counts), lambda: counts[counts > 0]):
        with pytest.raises(AssertionError, match="host"), NoHostRead(), NoHostSync():
            read()
