"""Prompts (text, image, video) as EngineRequests, an engine run that records sampled logits, greedy
tokens and top-k ids compared across layouts up to near ties, and an AsyncEngine served for one test body."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import torch
from gemma4_fixtures import BOI, BOS, EOI, IMAGE, NUM_SPECIALS, VIDEO, VOCAB, patchify

from mmserve.engine.llm import LLM
from mmserve.engine.types import EngineRequest
from mmserve.model.vision import pad_patches
from mmserve.request import MultiModalInput
from mmserve.sampling_params import SamplingParams

# (height, width) -> soft tokens with patch 4 and pooling 2: (h/8) * (w/8)
FRAME_SHAPES = {1: (8, 8), 2: (8, 16), 4: (16, 16), 6: (16, 24), 8: (16, 32), 9: (24, 24)}


def frame(gen: torch.Generator, tokens: int) -> MultiModalInput:
    h, w = FRAME_SHAPES[tokens]
    pix, pos = patchify(torch.rand(3, h, w, generator=gen), 4)
    return MultiModalInput(pix, pos)


def build_request(rid: str, parts: list, seed: int, max_tokens: int = 6, **kw) -> EngineRequest:
    """parts: ints (that many random text tokens), ("image", n) or ("video", [n, n, ...])."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ids, ranges, inputs, frames = [BOS], [], [], 0
    for p in parts:
        if isinstance(p, int):
            ids += [rng.randrange(NUM_SPECIALS, VOCAB) for _ in range(p)]
            continue
        kind, sizes = p
        for n in sizes if isinstance(sizes, list) else [sizes]:
            ids += [rng.randrange(NUM_SPECIALS, VOCAB)]          # a timestamp-like text token
            ids.append(BOI)
            ranges.append((len(ids), len(ids) + n - 1))
            ids += [VIDEO if kind == "video" else IMAGE] * n
            ids.append(EOI)
            inputs.append(frame(gen, n))
            frames += kind == "video"
    return EngineRequest(rid, ids, ranges, inputs, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw),
                         num_frames=frames, num_mm_tokens=sum(e - s + 1 for s, e in ranges))


PROMPTS = {
    "text": [40],
    "image": [5, ("image", 9), 20],
    "video": [3, ("video", [8, 8, 4, 8]), 6],
}


def make_llm(model_tok, **options) -> LLM:
    model, tok = model_tok
    # One budget for every step unless a test asks for the larger prefill budget: small budgets are
    # how these tests force chunked prefill.
    opts = dict(device="cpu", block_size=4, num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=64,
                prefill_batched_tokens=0)
    opts.update(options)
    return LLM(loaded_model=model, tokenizer=tok, **opts)


def run_recording_logits(llm: LLM, requests: list[EngineRequest]):
    """Generate, and record each request's sampled logits rows in order (the runner is wrapped, not replaced)."""
    logits: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in requests}
    execute = llm.core.runner.execute

    def recording_execute(out, *prev):   # (async scheduling: the step in flight's tokens)
        result = execute(out, *prev)
        for row, s in zip(result.logits, result.sampling, strict=True):
            logits[s.request.request_id].append(row.clone())
        return result

    llm.core.runner.execute = recording_execute
    completions = llm.generate(requests)
    return completions, {rid: torch.stack(rows) for rid, rows in logits.items()}


# Two layouts of one computation (batched vs alone, chunked vs one-shot, engine vs transformers) sum
# fp32 in other orders: on the random test checkpoint that moved a top-1/top-2 logit gap by 1.4e-6 to
# 3e-6 on average and at most 1.5e-5 (chunked vs transformers: 5e-6 mean, 3.0e-5 at most; 9,216
# decisions), while about 3e-4 of decisions have a gap below 1e-4. So greedy choices and top-k orders
# are compared exactly except between entries the reference holds within NEAR_TIE (~7x the largest
# layout noise measured, ~3x the largest engine-vs-transformers one), where either may come out on top.
NEAR_TIE = 1e-4


def record_decisions(engine) -> dict[str, list[torch.Tensor]]:
    """Per request, by output position, the logits row its token there was chosen from: the model's
    logits after bias, min_tokens and penalties (a grammar's mask, applied after, leaves the tokens
    it allows as they are). `engine`: an LLM or an EngineCore. Wraps the sampler's per-step plan; the
    dict fills as the engine runs. A verify chunk's row j decides the position after its j drafts;
    a position decided again (after a rejected draft) keeps its last row, the one on verified
    tokens. The async loop plans a step before the one in flight reaches the host: without
    speculation that one's token comes first; with it, how many of its rows the device kept is not
    known yet, so such an engine is refused (record a synchronous reference)."""
    core = getattr(engine, "core", engine)
    if core.async_scheduling and core.speculator is not None:
        raise ValueError("the async loop's speculating rows have no known position when planned")
    seen: dict[str, list[torch.Tensor]] = {}
    plan_step = core.sampler._plan

    def recording_plan(requests, vocab):
        plan = plan_step(requests, vocab)
        apply, rows = plan.adjust.apply, plan.rows
        # async: the rows of the step in flight before this one (the scheduler counted this one's too)
        in_flight = np.fromiter((getattr(r, "num_output_placeholders", 0) for r in rows.requests), dtype=np.int64,
                                count=len(rows.requests))
        positions = (rows.output_lengths() + (in_flight - rows.counts).clip(0)[rows.chunk_of_row]).tolist()

        def recording_apply(logits, dev):
            apply(logits, dev)
            for row, (chunk, position) in enumerate(zip(rows.chunk_of_row.tolist(), positions, strict=True)):
                decided = seen.setdefault(rows.requests[chunk].request_id, [])
                decided += [None] * (position + 1 - len(decided))
                decided[position] = logits[row].clone()

        plan.adjust.apply = recording_apply
        return plan

    core.sampler._plan = recording_plan
    return seen


def greedy_agree(want: list[int], got: list[int], logits, bound: float = NEAR_TIE) -> int:
    """`got` equals the reference's greedy tokens `want` up to their first divergence, where the
    reference's own logits there (`logits[i]`, the row token i was chosen from) hold both tokens within
    `bound` either way (a seeded sampled row's choice may be below the other): a near tie layout noise
    may flip. What follows a divergence is conditioned on another
    token and is not compared. Returns how many leading tokens are equal (all when none diverges)."""
    assert len(logits) >= len(want), "a logits row per reference token (a speculating one decides some past its last)"
    for i, (a, b) in enumerate(zip(want, got, strict=False)):
        if a != b:
            gap = (logits[i][a] - logits[i][b]).item()   # negative only for a sampled (seeded) row's choice
            assert abs(gap) < bound, f"token {i}: {b} where the reference chose {a}, logits {abs(gap):.3g} apart (bound {bound})"
            return i
    assert len(got) == len(want), (got, want)
    return len(want)


def assert_tokens_agree(want: dict[str, list[int]], got: dict[str, list[int]], decisions, cut=()) -> None:
    """`greedy_agree` for every request: `want` a reference's tokens by request id, `decisions` its
    `record_decisions`; a request in `cut` (aborted) may stop early, a prefix of the reference's."""
    assert set(got) == set(want), (set(got), set(want))
    for rid, tokens in want.items():
        n = min(len(got[rid]), len(tokens)) if rid in cut else len(tokens)
        greedy_agree(tokens[:n], got[rid], decisions[rid])


def near_tie_in(decisions, tokens: dict[str, list[int]], bound: float = NEAR_TIE) -> bool:
    """Whether a reference's greedy choice of one of `tokens` (by request id, `decisions` its
    `record_decisions`) was within `bound` of the runner-up: where a test needs another layout's
    tokens exactly (what they go on to change), it draws its inputs again instead."""
    rows = [row for rid, ids in tokens.items() for row in decisions[rid][:len(ids)]]
    return bool(rows) and bool((torch.stack(rows).topk(2).values.diff(dim=-1).neg() < bound).any())


def record_draft_gaps(engine) -> list[torch.Tensor]:
    """Per draft step of `engine`'s assistant (an LLM's or an EngineCore's, drafting eagerly or
    replaying emulated graphs), the top-two gap of each request's row it took the argmax of, as it
    runs (a replay's padding rows, which no request reads, left out): a draft within NEAR_TIE of
    another may come out otherwise in another layout, and with it which drafts the target keeps."""
    speculator = getattr(engine, "core", engine).speculator
    assistant, graphs, gaps = speculator.assistant, speculator.graphs, []
    step, replay = assistant.step, graphs.run
    requests_rows: list[int | None] = [None]   # a replay's requests (the rows before its padding); None: all

    def recording(*args, **kwargs):
        logits, hidden = step(*args, **kwargs)
        top = logits.topk(2, dim=-1).values
        gaps.append((top[..., 0] - top[..., 1])[:requests_rows[0]])
        return logits, hidden

    def replaying(tokens, *args, **kwargs):
        requests_rows[0] = len(tokens)
        try:
            return replay(tokens, *args, **kwargs)
        finally:
            requests_rows[0] = None

    assistant.step, graphs.run = recording, replaying
    return gaps


def assert_top_ids_close(top_ids, reference: torch.Tensor, k: int, bound: float = NEAR_TIE) -> None:
    """`top_ids` (best first) are `reference`'s top `k`, save that entries whose reference values lie
    within `bound` of each other may come in either order (at the k-th place: either may be in)."""
    ids = list(top_ids)
    best = torch.topk(reference, k).values
    assert len(set(ids)) == len(ids) == k and ((reference[ids] - best).abs() < bound).all(), (ids, best, reference[ids])


def assert_rank_close(rank: int, token: int, reference: torch.Tensor, bound: float = NEAR_TIE) -> None:
    """`rank` is `token`'s 1-based rank in `reference`, the entries within `bound` of it on either side."""
    value = reference[token]
    assert int((reference > value + bound).sum()) < rank <= int((reference > value - bound).sum()), (rank, token)


def assert_token_logprobs_close(ours, theirs, logits_row: torch.Tensor, bound: float = NEAR_TIE) -> None:
    """A generated token's logprobs (TokenLogprobs) as the reference's `theirs`, whose model logits (no
    bias or penalties) were `logits_row`: the same token and values to 1e-4, the rank and top ids
    those of that row up to near ties (`assert_rank_close`, `assert_top_ids_close`)."""
    reference = torch.log_softmax(logits_row.float(), dim=-1)
    assert ours.token_id == theirs.token_id
    torch.testing.assert_close(torch.tensor([ours.logprob, *ours.top_logprobs]),
                               torch.tensor([theirs.logprob, *theirs.top_logprobs]), rtol=1e-4, atol=1e-4)
    assert_rank_close(ours.rank, ours.token_id, reference, bound)
    assert_top_ids_close(ours.top_ids, reference, len(theirs.top_ids), bound)


def hf_logits(hf, req: EngineRequest, output_ids: list[int] = ()) -> torch.Tensor:
    """transformers' logits [L, V] at every position of the prompt followed by `output_ids`."""
    cfg = hf.config
    ids = torch.tensor([req.prompt_token_ids + list(output_ids)])
    kwargs = {"mm_token_type_ids": (ids == cfg.image_token_id).long() + 2 * (ids == cfg.video_token_id).long()}
    images = [(m.pixel_values, m.position_ids) for m, (s, _) in zip(req.mm_inputs, req.mm_ranges, strict=True)
              if req.prompt_token_ids[s] == cfg.image_token_id]
    frames = [(m.pixel_values, m.position_ids) for m, (s, _) in zip(req.mm_inputs, req.mm_ranges, strict=True)
              if req.prompt_token_ids[s] == cfg.video_token_id]
    if images:
        kwargs["pixel_values"], kwargs["image_position_ids"] = pad_patches(images)
    if frames:
        kwargs["pixel_values_videos"], kwargs["video_position_ids"] = pad_patches(frames)
        kwargs["num_frames_per_video"] = torch.tensor([len(frames)])
    with torch.no_grad():
        return hf(input_ids=ids, **kwargs).logits[0]


def serve(engine, body):
    """Start the AsyncEngine `engine`, await `body(engine)` and shut it down (also when the body fails);
    the body's result."""
    async def main():
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def step_through(llm: LLM, requests: list[EngineRequest], *, arrivals: dict[str, int] | None = None,
                 aborts: dict[str, int] | None = None,
                 errors: dict[str, BaseException] | None = None) -> tuple[dict[str, list[int]], set[str]]:
    """Step `llm` until it is idle: each request added at its arrival step (0 when not in
    `arrivals`), each in `aborts` aborted after that step if it still runs then. Returns every
    request's emitted tokens and the ids it aborted; any error a step reports fails the test, or
    goes into `errors` (request id -> error) when given."""
    arrivals, aborts = arrivals or {}, aborts or {}
    tokens = {r.request_id: [] for r in requests}
    pending, aborted, step = list(requests), set(), 0
    while pending or llm.has_work:
        for r in [r for r in pending if arrivals.get(r.request_id, 0) <= step]:
            llm.add_request(r)
            pending.remove(r)
        for rid, item in llm.step():
            if isinstance(item, BaseException) and errors is not None:
                errors[rid] = item
                continue
            assert not isinstance(item, BaseException), (rid, item)
            tokens[rid] += item.new_token_ids
        step += 1
        for rid, at in aborts.items():
            if at == step and rid not in aborted and llm.core.abort(rid):
                llm.processor.forget(rid)
                aborted.add(rid)
    return tokens, aborted


def step_core(core, requests: list[EngineRequest], *, arrivals: dict[str, int] | None = None,
              after_step=None, check_errors: bool = True) -> dict[str, list[int]]:
    """`step_through` for an EngineCore driven directly (no front end: rank 0 of the tensor-parallel
    tests): each request added at its arrival step, stepped until idle; `after_step(step, outputs)`
    sees each step's EngineCoreOutputs once its tokens are taken (1-based step count). A step's error
    fails the test (with `check_errors` False, `after_step` judges them). Returns every request's tokens."""
    arrivals = arrivals or {}
    tokens = {r.request_id: [] for r in requests}
    pending, step = list(requests), 0
    while pending or core.has_work:
        for r in [r for r in pending if arrivals.get(r.request_id, 0) <= step]:
            core.add_request(r.core_request())
            pending.remove(r)
        result = core.step()
        for out in result.outputs:
            assert out.error is None or not check_errors, out
            tokens[out.request_id] += out.new_token_ids
        step += 1
        if after_step is not None:
            after_step(step, result)
    return tokens


def tiny_grammar(tmp_path):
    """Real xgrammar structured output over the tiny checkpoints' tokenizer (saved under `tmp_path`):
    (StructuredOutput, tokenizer, vocab size)."""
    from gemma4_fixtures import EOS, make_tokenizer

    from mmserve.model.tokenizer import load_tokenizer
    from mmserve.structured_output.compiler import FormatCompiler
    from mmserve.structured_output.manager import StructuredOutput

    make_tokenizer().save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(tmp_path)
    grammar = StructuredOutput(FormatCompiler(tokenizer, VOCAB, [EOS], cache_bytes=2**20, timeout_s=float("inf")))
    return grammar, tokenizer, VOCAB
