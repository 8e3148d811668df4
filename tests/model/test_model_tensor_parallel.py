"""Tensor parallelism of the decoder: TP=2 over two real gloo processes gives TP=1's logits.

Fresh random tiny checkpoints of each variant (dense with K=V full layers whose single KV head is
replicated, E-style with per-layer embeddings and KV sharing, MoE with the experts split, unified,
an untied head without soft-cap);
a chunked prefill whose chunks carry an image and video frames, then decode steps; and the
speculative drafter (tied head and centroid head) drafting from a target's sharded K/V through the
engine's own draft loop. One spawn of two ranks for the whole module (`tp2_runs`); each rank loads
only its shard (checked by the bytes it read against the bytes it holds).
"""

from __future__ import annotations

import contextlib
import random
import re

import pytest
import torch
import torch.multiprocessing as mp
from gemma4_fixtures import (
    NUM_SPECIALS,
    VOCAB,
    PagedSequence,
    e_model_config,
    make_assistant,
    make_checkpoint,
    make_tokenizer,
    moe_config,
    tiny_config,
    unified_config,
)
from test_model_parity import run_ours, video_prompt

from mmserve.engine.speculative import DraftBatch, Speculator
from mmserve.model import load_model
from mmserve.model.assistant import load_assistant
from mmserve.model.parallel import SINGLE, ParallelGroup, ShardingError, join_group, local_spec
from mmserve.model.prompt import build_prompt
from mmserve.model.spec import load_spec
from mmserve.model.tokenizer import TextTokenizer


def untied_config() -> dict:
    """A separate (vocab-parallel) lm_head without soft-cap, separate V projections, causal frames."""
    cfg = tiny_config(window=5, attention_k_eq_v=False, use_bidirectional_attention=None,
                      final_logit_softcapping=None, tie_word_embeddings=False)
    cfg["tie_word_embeddings"] = False
    return cfg


VARIANTS = {"dense": (tiny_config, False), "e_style": (e_model_config, False), "moe": (moe_config, False),
            "unified": (unified_config, True), "untied": (untied_config, False)}
DRAFTERS = {"lm_head": False, "centroids": True}   # the assistant's head: tied lm_head, or ordered embeddings
NUM_DRAFTS = 3


def run_steps(model, layout, chunk_end: int, decode_ids: list[int]) -> torch.Tensor:
    """Logits of every row: prefill in two chunks (vision encoded per chunk), then one decode step per id."""
    return run_ours(model, layout, [chunk_end], decode_ids)


def state_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


class BestBanned:
    """A grammar's place in the draft loop (structured_output.DraftMasks' interface), held by rank 0
    alone as the engine's masks are: it forbids each draft step's unmasked best token, so a rank
    that drafted from its own unmasked argmax would feed a different token than rank 0."""

    def __init__(self, num_drafts: list[int]):
        self.lengths = list(num_drafts)

    def apply(self, logits: torch.Tensor) -> None:
        logits.scatter_(1, logits.argmax(-1, keepdim=True), float("-inf"))

    def advance(self, step: int, tokens: list[int]) -> None:
        pass

    def rollback(self) -> None:
        pass


def run_drafts(target_path, assistant_path, ids: list[int], first: int, dtype: torch.dtype,
               group: ParallelGroup = SINGLE, masked: bool = False) -> dict:
    """A prefill of `ids`, then one drafting round from `first` through the engine's draft loop
    (`Speculator.draft`, as every rank runs it): each draft step's logits, the drafts, load accounting.
    `masked`: rank 0 masks the drafts (BestBanned), as it does a constrained request's."""
    model = load_model(target_path, dtype=dtype, parallel=group)
    assistant = load_assistant(assistant_path, model.decoder.spec, dtype=dtype, device=model.device, parallel=group)
    speculator = Speculator(assistant, model, NUM_DRAFTS)
    logits, step = [], assistant.step

    def recording_step(*args):   # the real step; its logits kept
        out = step(*args)
        logits.append(out[0].clone())   # before any mask
        return out

    assistant.step = recording_step
    seq = PagedSequence(model, block_size=4, num_blocks=32, seed=5)
    hidden = seq.step(ids)
    tables = {t: [seq.blocks.tolist()] for t in speculator.stores}
    batch = DraftBatch([first], [len(ids) - 1], [len(ids)], [NUM_DRAFTS], tables, seq.block_size, masked=masked)
    drafts = speculator.draft(batch, hidden, seq.kv_caches,
                              BestBanned(batch.num_drafts) if masked and group.rank == 0 else None)
    return dict(logits=torch.stack(logits)[:, 0], drafts=drafts, bytes_read=assistant.bytes_read,
                bytes_held=state_bytes(assistant))


def _rank_main(rank: int, init_method: str, cases: dict, drafters: dict, out_dir: str) -> None:
    """One rank: load each checkpoint's shard, run the same steps, save logits and load accounting."""
    torch.set_num_threads(1)
    group = join_group(rank, 2, init_method, timeout_s=120)
    results = {f"drafter_{name}": {str(dtype): run_drafts(*case, dtype, group) for dtype in (torch.float64, torch.float32)}
               for name, case in drafters.items()}
    results["drafter_masked"] = run_drafts(*drafters["lm_head"], torch.float64, group, masked=True)
    for name, (path, layout, chunk_end, decode_ids) in cases.items():
        exact = run_steps(load_model(path, dtype=torch.float64, parallel=group), layout, chunk_end, decode_ids)
        model = load_model(path, parallel=group)
        results[name] = dict(logits=run_steps(model, layout, chunk_end, decode_ids), logits64=exact,
                             bytes_read=model.bytes_read, bytes_held=state_bytes(model),
                             kv_heads={t: a.num_kv_heads for t, a in model.spec.attention_specs.items()})
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def tp_cases(tmp_path_factory):
    """{variant: (checkpoint, prompt layout, chunk end, decode ids)} on fresh random weights and inputs."""
    seed = random.SystemRandom().randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    root = tmp_path_factory.mktemp("tp")
    cases = {}
    for i, (name, (config, unified)) in enumerate(VARIANTS.items()):
        path = root / name
        make_checkpoint(path, config=config(), seed=seed + i, unified=unified)
        spec = load_spec(path)
        layout = build_prompt(TextTokenizer(make_tokenizer()), spec, video_prompt(spec, gen))
        decode_ids = torch.randint(NUM_SPECIALS, VOCAB, (2,), generator=gen).tolist()
        cases[name] = (path, layout, layout.mm_ranges[1][1] + 1, decode_ids)
    return seed, cases


@pytest.fixture(scope="module")
def drafter_cases(tmp_path_factory):
    """{head: (target, assistant, prompt ids, first token)}: a dense target (its sliding layers' 2 KV
    heads split, its full layers' one replicated) and a fresh random assistant per head kind; the
    prompt is longer than both sliding windows."""
    seed = random.SystemRandom().randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    root = tmp_path_factory.mktemp("tp_drafters")
    cfg = tiny_config(window=6)
    make_checkpoint(root / "target", config=cfg, seed=seed)
    cases = {}
    for i, (name, ordered) in enumerate(DRAFTERS.items()):
        make_assistant(root / name, cfg, seed=seed + 1 + i, ordered=ordered)
        ids = torch.randint(NUM_SPECIALS, VOCAB, (19,), generator=gen).tolist()
        cases[name] = (root / "target", root / name, ids, int(torch.randint(NUM_SPECIALS, VOCAB, (1,), generator=gen)))
    return seed, cases


@pytest.fixture(scope="module")
def tp2_runs(tp_cases, drafter_cases, tmp_path_factory):
    """Both ranks' results, from one spawn of two gloo processes."""
    out = tmp_path_factory.mktemp("tp_out")
    mp.spawn(_rank_main, args=(f"file://{out}/rendezvous", tp_cases[1], drafter_cases[1], str(out)), nprocs=2,
             join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def max_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest deviation as a share of the largest logit (the parity tests' measure)."""
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2_logits_equal_tp1(variant, tp_cases, tp2_runs):
    """In fp64 TP=2 equals TP=1 to 1e-10 (any sharding mistake is O(1)); in fp32 within 1e-4, and
    no further from the fp64 truth than TP=1 is. (fp32 TP=1 itself is up to ~5e-5 from fp64 on these
    ill-conditioned random models, so the all-reduces' reordered sums move logits by ~1e-5.)"""
    seed, cases = tp_cases
    path, layout, chunk_end, decode_ids = cases[variant]
    ref64 = run_steps(load_model(path, dtype=torch.float64), layout, chunk_end, decode_ids)
    ref = run_steps(load_model(path), layout, chunk_end, decode_ids)
    for rank in range(2):   # every rank gathered the full vocabulary
        run = tp2_runs[rank][variant]
        assert run["logits"].shape == ref.shape and run["logits"].dtype == torch.float32
        assert max_error(run["logits64"], ref64) < 1e-10, f"seed {seed}, rank {rank}"
        assert max_error(run["logits"], ref) < 1e-4, f"seed {seed}, rank {rank}"
        assert max_error(run["logits"], ref64) <= 2 * max_error(ref, ref64) + 1e-6, f"seed {seed}, rank {rank}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_rank_reads_only_its_shard(variant, tp_cases, tp2_runs):
    """The bytes a rank read from the checkpoint are exactly the bytes it holds (fp32 checkpoint,
    fp32 model): nothing of another rank's shard was read and dropped; and less than TP=1 holds."""
    _, cases = tp_cases
    whole = load_model(cases[variant][0])
    for rank in range(2):
        run = tp2_runs[rank][variant]
        assert run["bytes_read"] == run["bytes_held"]
        assert run["bytes_held"] < 0.75 * state_bytes(whole)


@pytest.mark.parametrize("head", list(DRAFTERS))
def test_tp2_drafter_equals_tp1(head, drafter_cases, tp2_runs):
    """The drafter sharded like its target, reading each rank's shard of the target's K/V: every
    draft step's logits equal TP=1's in fp64 to 1e-10 (a sharding mistake is O(1)), with TP=1's
    drafts; in fp32 within 1e-3, every rank drafting the same tokens (the target's own fp32 TP=2
    deviation, up to ~1e-4 on these ill-conditioned random models, reaches the drafter through its
    hidden state and K/V: seen from 7e-6 to 1.3e-4; a precision slip, e.g. a bf16 all-reduce, is ~1e-2); each rank read only its shard of the assistant
    (the replicated projections and norms make it more than half)."""
    seed, cases = drafter_cases
    ref64, ref = run_drafts(*cases[head], torch.float64), run_drafts(*cases[head], torch.float32)
    for rank in range(2):
        run64, run = (tp2_runs[rank][f"drafter_{head}"][str(dtype)] for dtype in (torch.float64, torch.float32))
        assert run64["logits"].shape == run["logits"].shape == (NUM_DRAFTS, VOCAB)
        assert max_error(run64["logits"], ref64["logits"]) < 1e-10, f"seed {seed}, rank {rank}"
        assert run64["drafts"] == ref64["drafts"], f"seed {seed}, rank {rank}"
        assert max_error(run["logits"], ref["logits"]) < 1e-3, f"seed {seed}, rank {rank}"
        assert run["drafts"] == tp2_runs[0][f"drafter_{head}"][str(torch.float32)]["drafts"]
        assert run["bytes_read"] == run["bytes_held"] < 0.8 * ref["bytes_held"]


def test_kv_heads_split_or_replicated(tp2_runs):
    """Sliding layers' 2 KV heads split one per rank; full layers' single KV head is on both."""
    for rank in range(2):
        assert tp2_runs[rank]["dense"]["kv_heads"] == {"sliding_attention": 1, "full_attention": 1}


@pytest.mark.parametrize("variant, size, dimension", [
    ("dense", 3, "vocab_size (320)"), ("dense", 8, "attention heads (4)"),
    ("moe", 4, "num_experts (6)"), ("e_style", 16, "hidden_size_per_layer_input (8)")])
def test_sizes_that_do_not_divide_are_refused(variant, size, dimension, tp_cases):
    _, cases = tp_cases
    with pytest.raises(ShardingError, match=re.escape(dimension)):
        local_spec(load_spec(cases[variant][0]), ParallelGroup(0, size))


def test_tp2_drafts_masked_on_rank_0_reach_every_rank(drafter_cases, tp2_runs):
    """A constrained round: rank 0 alone masks (a stand-in grammar that bans each step's best
    token), and its drafts are every rank's: TP=2 equals TP=1 masked the same way (fp64, 1e-10),
    which it could not if rank 1 fed its own unmasked argmax to the next draft step."""
    seed, cases = drafter_cases
    ref = run_drafts(*cases["lm_head"], torch.float64, masked=True)
    assert ref["drafts"] != run_drafts(*cases["lm_head"], torch.float64)["drafts"]   # the mask changed them
    for rank in range(2):
        run = tp2_runs[rank]["drafter_masked"]
        assert max_error(run["logits"], ref["logits"]) < 1e-10, f"seed {seed}, rank {rank}"
        assert run["drafts"] == tp2_runs[0]["drafter_masked"]["drafts"]
    assert tp2_runs[0]["drafter_masked"]["drafts"] == ref["drafts"], f"seed {seed}"


def test_an_assistant_that_does_not_divide_is_refused_before_any_spawn(drafter_cases, tmp_path):
    """The target splits 4 ways; its 2-head assistant does not: refused naming the assistant's dimension."""
    from mmserve.config import EngineConfig
    from mmserve.engine.tensor_parallel import check_divisible

    _, cases = drafter_cases
    target = cases["lm_head"][0]
    make_assistant(tmp_path / "narrow", tiny_config(window=6), num_attention_heads=2)
    config = EngineConfig(model=str(target), speculative_model=str(tmp_path / "narrow"), tensor_parallel_size=4)
    with pytest.raises(ShardingError, match=re.escape("assistant sliding_attention attention heads (2)")):
        check_divisible(config)
    check_divisible(EngineConfig(model=str(target), speculative_model=str(cases["lm_head"][1]), tensor_parallel_size=4))


@pytest.mark.parametrize("grouped", [False, True])
def test_expert_shards_sum_to_all_experts(grouped, monkeypatch):
    """Each rank's experts (a contiguous half) give their share of the routed sum; the two shares add
    up to the unsplit layer's output, on the CPU loop and on the CUDA grouped-GEMM path (forced; it
    must still read nothing on the host). The collective itself is the all-reduce the spawned tests
    above exercise; here the shares are summed directly."""
    from test_model_moe import NoHostRead, NoHostSync

    from mmserve.model import moe as moe_module
    from mmserve.model.moe import Experts, Router
    from mmserve.model.spec import MoeSpec

    hidden, moe = 24, MoeSpec(num_experts=6, top_k=3, intermediate=16)
    whole = Experts(hidden, moe)
    router = Router(hidden, moe, 1e-6)
    with torch.no_grad():
        for p in list(whole.parameters()) + list(router.parameters()):
            p.normal_(0, 0.3)
        x = torch.randn(random.randint(1, 20), hidden)
        weights, experts = router(x)
        reference = whole(x, weights, experts)
        shares = []
        for rank in range(2):
            part = Experts(hidden, moe, ParallelGroup(rank, 2))
            part.gate_up_proj.copy_(whole.gate_up_proj[3 * rank:3 * rank + 3])
            part.down_proj.copy_(whole.down_proj[3 * rank:3 * rank + 3])
            monkeypatch.setattr(moe_module, "uses_grouped_mm", lambda t: grouped)
            with NoHostRead() if grouped else contextlib.nullcontext(), \
                    NoHostSync() if grouped else contextlib.nullcontext():
                shares.append(part(x, weights, experts))
            monkeypatch.undo()
            mine = set(experts.flatten().tolist()) & set(range(3 * rank, 3 * rank + 3))
            assert int(part.touched) == len(mine)
    torch.testing.assert_close(shares[0] + shares[1], reference, rtol=1e-5, atol=1e-6)
