"""Tensor parallelism of the decoder: TP=2 over two real gloo processes gives TP=1's logits.

Fresh random tiny checkpoints of each variant (dense with K=V full layers whose single KV head is
replicated, E-style with per-layer embeddings and KV sharing, MoE with the experts split, unified,
an untied head without soft-cap);
a chunked prefill whose chunks carry an image and video frames, then decode steps; and the
speculative drafter (tied head and centroid head) drafting from a target's sharded K/V through the
engine's own draft loop. One spawn of two ranks for the whole module (`tp2_runs`); each rank loads
only its shard (checked by the bytes it read against the bytes it holds). The same ranks count
the bytes of every collective they really call, per call site, while running steps as the
engine's runner takes them (`runner_steps`) and a drafting round: the perf model's communication
component must bill exactly those; and its per-GPU vision and PLE bytes must be what each rank
holds (the tower replicated, the PLE table and projection split).
"""

from __future__ import annotations

import contextlib
import random
import re
import sys
from collections import defaultdict

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
    runner_tables,
    tiny_config,
    unified_config,
)
from test_model_parity import run_ours, video_prompt

from mmserve.metrics.perf_model import DraftWork, PerfModel, RequestWork, StepContext, VisionWork
from mmserve.model import load_model, parallel
from mmserve.model.assistant import load_assistant
from mmserve.model.assistant_spec import load_assistant_spec
from mmserve.model.decoder import SampledRows
from mmserve.model.parallel import SINGLE, ParallelGroup, ShardingError, join_group, local_spec
from mmserve.model.prompt import build_prompt
from mmserve.model.spec import load_spec
from mmserve.model.tokenizer import TextTokenizer
from mmserve.model.vision import pad_patches
from mmserve.spec_decode.speculator import DraftBatch, Speculator


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


# The function that called a collective (through model/parallel.py) -> the perf model's site name.
COLLECTIVE_SITES = {"TextDecoder.embed": "embed", "Attention.forward": "o_proj", "MLP.reduce": "mlp",
                    "MoeBlock.forward": "moe", "PerLayerEmbeddings.forward": "ple",
                    "TextDecoder.compute_logits": "logits", "DraftLayerAttention.forward": "o_proj",
                    "CentroidHead.forward": "centroid_scores", "Assistant.step": "logits",
                    "Speculator.draft": "token", "Speculator._loop": "token"}


@contextlib.contextmanager
def counted_collectives():
    """{site: payload bytes} of every torch.distributed all_reduce / all_gather / broadcast this
    process calls inside the block, the real collectives still running: the tensor's numel x
    element_size (an all-gather's gathered size), under the perf model's site name, "drafter_"
    before it when the engine's draft loop called it, "unknown ..." for a caller it does not bill."""
    import torch.distributed as dist

    counts: dict[str, int] = defaultdict(int)
    real = {kind: getattr(dist, kind) for kind in ("all_reduce", "all_gather", "broadcast")}

    def site(kind: str) -> str:
        frame = sys._getframe(2)
        while frame.f_code.co_filename == parallel.__file__:   # ParallelGroup's methods, `collective`
            frame = frame.f_back
        caller, drafting = frame.f_code.co_qualname, False
        while frame is not None:
            drafting |= frame.f_code.co_qualname == "Speculator.draft"
            frame = frame.f_back
        if caller not in COLLECTIVE_SITES:
            return f"unknown {kind} from {caller}"
        return ("drafter_" if drafting else "") + f"{COLLECTIVE_SITES[caller]}_{kind}"

    def wrap(kind: str):
        def counting(*args, **kwargs):
            if kind == "all_gather":
                parts, tensor = args[0], args[1]
                payload = len(parts) * tensor.numel() * tensor.element_size()
            else:
                payload = args[0].numel() * args[0].element_size()
            counts[site(kind)] += payload
            return real[kind](*args, **kwargs)
        return counting

    for kind in real:
        setattr(dist, kind, wrap(kind))
    try:
        yield counts
    finally:
        for kind, fn in real.items():
            setattr(dist, kind, fn)


def runner_step(model, seq: PagedSequence, ids: list[int], items: list, sampled: list[int]) -> torch.Tensor:
    """One request's step as worker/model_runner.py takes it: its frames encoded; with KV-sharing
    layers and a row that does not sample, those layers on the `sampled` rows alone (a prompt's
    last row, or none for a chunk that does not end its prompt), else every row; the logits of the
    `sampled` rows."""
    embeds = None
    if items:
        pix, pos = pad_patches([(it.pixel_values, it.position_ids) for it in items])
        embeds = torch.cat(model.encode_vision(pix, pos))
    if any(layer.shares_kv for layer in model.spec.layers) and len(sampled) < len(ids):
        if sampled:
            return model.compute_logits(seq.step(ids, embeds, last_row_only=True))
        md = seq.metadata(len(ids))
        input_ids = torch.tensor(ids, dtype=torch.long, device=model.device)
        index = torch.nonzero((input_ids == model.spec.image_token_id)
                              | (input_ids == model.spec.video_token_id)).flatten()
        hidden = model.forward(input_ids, md.positions, seq.backend_metadata(md), seq.kv_caches, embeds, index,
                               SampledRows(torch.zeros(0, dtype=torch.long, device=model.device), {}))
        seq.num_computed += len(ids)
        return model.compute_logits(hidden)
    return model.compute_logits(seq.step(ids, embeds)[sampled])


def runner_steps(layout, chunk_end: int, decode_ids: list[int]) -> list[tuple[list[int], list, list[int]]]:
    """(ids, frames, rows that sample) of each step: a prefill chunk with the image and the first
    frame that samples nothing, the prompt's last chunk (its last row samples), a decode token, a
    verify chunk of 1 + 3 tokens (every row samples, so KV-sharing layers run every row)."""
    ids, pairs = layout.token_ids, list(zip(layout.mm_ranges, layout.mm_items, strict=True))
    verify = (decode_ids * 2)[:4]
    return [(ids[:chunk_end], [it for (s, _), it in pairs if s < chunk_end], []),
            (ids[chunk_end:], [it for (s, _), it in pairs if s >= chunk_end], [len(ids) - chunk_end - 1]),
            (decode_ids[:1], [], [0]), (verify, [], list(range(len(verify))))]


def runner_contexts(layout, chunk_end: int, decode_ids: list[int]) -> list[StepContext]:
    """The perf model's view of `runner_steps`."""
    n, ranges = len(layout.token_ids), tuple(layout.mm_ranges)
    return [StepContext((RequestWork(chunk_end, chunk_end, True, ranges, samples=False),)),
            StepContext((RequestWork(n - chunk_end, n, True, ranges),)),
            StepContext((RequestWork(1, n + 1, False, ranges),)),
            StepContext((RequestWork(4, n + 5, False, ranges),))]


def run_counted(model, layout, chunk_end: int, decode_ids: list[int]) -> list[dict[str, int]]:
    """Each of `runner_steps`' collective payloads, per site."""
    seq, counted = PagedSequence(model, ranges=layout.mm_ranges), []
    for ids, items, sampled in runner_steps(layout, chunk_end, decode_ids):
        with counted_collectives() as counts:
            runner_step(model, seq, ids, items, sampled)
        counted.append(dict(counts))
    return counted


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
    (`Speculator.draft`, as every rank runs it): each draft step's logits, the drafts, load accounting,
    the round's collectives. `masked`: rank 0 masks the drafts (BestBanned), as it does a constrained
    request's."""
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
    tables = runner_tables(speculator.stores, {"seq": seq.blocks.tolist()}, len(seq.blocks))
    batch = DraftBatch([first], [len(ids) - 1], [len(ids)], [NUM_DRAFTS], ["seq"], seq.block_size, masked=masked)
    with counted_collectives() as comm:
        drafts = speculator.draft(batch, hidden, seq.kv_caches, tables,
                                  BestBanned(batch.num_drafts) if masked and group.rank == 0 else None)
    return dict(logits=torch.stack(logits)[:, 0], drafts=drafts, bytes_read=assistant.bytes_read,
                bytes_held=state_bytes(assistant), comm=dict(comm))


def _rank_main(rank: int, init_method: str, cases: dict, drafters: dict, out_dir: str) -> None:
    """One rank: load each checkpoint's shard, run the same steps, save logits and load accounting."""
    torch.set_num_threads(1)
    group = join_group(rank, 2, init_method, timeout_s=120)
    results = {f"drafter_{name}": {str(dtype): run_drafts(*case, dtype, group) for dtype in (torch.float64, torch.float32)}
               for name, case in drafters.items()}
    results["drafter_masked"] = run_drafts(*drafters["lm_head"], torch.float64, group, masked=True)
    for name, (path, layout, chunk_end, decode_ids) in cases.items():
        model64 = load_model(path, dtype=torch.float64, parallel=group)
        exact = run_steps(model64, layout, chunk_end, decode_ids)
        model = load_model(path, parallel=group)
        results[name] = dict(logits=run_steps(model, layout, chunk_end, decode_ids), logits64=exact,
                             bytes_read=model.bytes_read, bytes_held=state_bytes(model),
                             kv_heads={t: a.num_kv_heads for t, a in model.spec.attention_specs.items()},
                             vision_bytes=state_bytes(model.vision),
                             param_bytes={n: t.numel() * t.element_size() for n, t in model.named_parameters()},
                             comm={str(m.dtype): run_counted(m, layout, chunk_end, decode_ids) for m in (model, model64)})
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def tp_cases(tmp_path_factory):
    """{variant: (checkpoint, prompt layout, chunk end, decode ids)} on fresh random weights and inputs."""
    seed = random.randrange(2**31)
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
    seed = random.randrange(2**31)
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
    no further from the fp64 truth than TP=1 is. (fp32 TP=1 itself is up to ~1e-4 from fp64 on these
    ill-conditioned random models (1.01e-4 under salt 2, dense), so the all-reduces' reordered sums
    move logits by ~1e-5: 1.3e-5 at most over 4 salts x 5 variants.)"""
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
    assert ref64["comm"] == ref["comm"] == {}   # at tp=1 no collective is called


@pytest.mark.parametrize("variant", ["dense", "unified"])
def test_vision_is_replicated_and_billed_whole(variant, tp_cases, tp2_runs):
    """Every rank holds the whole vision tower (or the unified embedder), so the perf model bills
    each GPU the whole encoder at tp=2: the same FLOPs and bytes as the unsplit model."""
    _, cases = tp_cases
    path = cases[variant][0]
    whole = load_model(path)
    for rank in range(2):
        assert tp2_runs[rank][variant]["vision_bytes"] == state_bytes(whole.vision)
    spec = load_spec(path)
    frames = StepContext(images=(VisionWork(spec.vision.default_patches),) * 3)
    per_gpu = PerfModel(spec, tp=2).step(frames, per_gpu=True).component("vision")
    assert per_gpu.total_flops > 0
    assert per_gpu.as_dict() == PerfModel(spec).step(frames).component("vision").as_dict()


def test_ple_weights_billed_as_each_rank_holds_them(tp_cases, tp2_runs):
    """E-style at tp=2: the perf model's per-GPU PLE bytes are the rank's own parameters: half the
    model-level projection and half of each token-table row (split along the per-layer width), and
    every layer's whole gate and projection (replicated)."""
    _, cases = tp_cases
    spec = load_spec(cases["e_style"][0])
    billed = PerfModel(spec, dtype="float32", tp=2).step(StepContext((RequestWork(1, 12, False),)), per_gpu=True)
    for rank in range(2):
        held = tp2_runs[rank]["e_style"]["param_bytes"]
        assert billed.read_bytes["ple.model_projection_weight"] == held["decoder.ple.per_layer_model_projection.weight"]
        assert billed.read_bytes["ple.token_rows"] == held["decoder.ple.embed_tokens_per_layer.weight"] / spec.ple.vocab_size
        gates = [n for n in held if re.fullmatch(r"decoder\.layers\.\d+\.ple\.per_layer_(input_gate|projection)\.weight", n)]
        assert len(gates) == 2 * spec.num_layers
        assert billed.read_bytes["ple.layer_weight"] == sum(held[n] for n in gates)


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
    from mmserve.executor.ranks import check_divisible

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


RING_SENT = {"all_reduce": 2 * (2 - 1) / 2, "all_gather": (2 - 1) / 2, "broadcast": (2 - 1) / 2}   # of 2 GPUs


def sent(counted: dict[str, int]) -> dict[str, float]:
    """Counted payloads -> the bytes one of two GPUs sends under ring algorithms (an all-reduce
    2(N-1)/N of its tensor, an all-gather (N-1)/N of the gathered one, a broadcast the group's (N-1)
    sends averaged over N), keyed as the perf model keys them; empty collectives dropped."""
    out = {}
    for site, payload in counted.items():
        kind = next((k for k in RING_SENT if site.endswith(k)), None)
        assert kind is not None, f"a collective the perf model does not bill: {site}"
        if payload:
            out[f"comm.{site}"] = RING_SENT[kind] * payload
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_comm_bytes_equal_the_collectives_run(variant, tp_cases, tp2_runs):
    """Per step and per call site, the perf model's communication bytes at tp=2 are exactly what
    the real TP=2 model sent (payloads counted inside torch.distributed on both ranks, the ring
    convention applied): a prefill chunk with an image and a frame (vision replicated: no
    collective), the prompt's last chunk (E-style: KV-sharing layers on the sampled row alone),
    a decode token and a verify chunk (every row through every layer); in fp32 and fp64 (the bytes
    of the dtype each tensor has: logits are gathered before they become float32)."""
    seed, cases = tp_cases
    path, layout, chunk_end, decode_ids = cases[variant]
    for dtype in ("float32", "float64"):
        perf = PerfModel(load_spec(path), dtype=dtype, tp=2)
        want = [dict(perf.step(ctx, per_gpu=True).comm_bytes) for ctx in runner_contexts(layout, chunk_end, decode_ids)]
        for rank in range(2):
            got = [sent(step) for step in tp2_runs[rank][variant]["comm"][f"torch.{dtype}"]]
            assert got == want, f"seed {seed}, rank {rank}, {dtype}"
    sites = {site for step in want for site in step}
    assert {"comm.embed_all_reduce", "comm.o_proj_all_reduce", "comm.mlp_all_reduce",
            "comm.logits_all_gather"} <= sites
    assert ("comm.ple_all_gather" in sites) == (variant == "e_style")
    assert ("comm.moe_all_reduce" in sites) == (variant == "moe")


@pytest.mark.parametrize("head", [*DRAFTERS, "masked"])
def test_drafter_comm_bytes_equal_the_collectives_run(head, drafter_cases, tp2_runs):
    """A drafting round's collectives at tp=2 (the target's embedding of the drafted-from tokens,
    each layer's o_proj and MLP, the tied head's logits or the centroid head's scores, and for a
    constrained round rank 0's drafts broadcast) are exactly what the perf model bills its drafter."""
    seed, cases = drafter_cases
    target, assistant, ids, _ = cases["lm_head" if head == "masked" else head]
    dtype = torch.float64 if head == "masked" else torch.float32
    perf = PerfModel(load_spec(target), dtype=str(dtype).removeprefix("torch."), tp=2,
                     drafter=load_assistant_spec(assistant))
    want = dict(perf.step(StepContext(drafts=(DraftWork(NUM_DRAFTS, len(ids), constrained=head == "masked"),)),
                          per_gpu=True).comm_bytes)
    assert ("comm.drafter_token_broadcast" in want) == (head == "masked")
    for rank in range(2):
        run = tp2_runs[rank]["drafter_masked"] if head == "masked" else tp2_runs[rank][f"drafter_{head}"][str(dtype)]
        assert sent(run["comm"]) == want, f"seed {seed}, rank {rank}"
