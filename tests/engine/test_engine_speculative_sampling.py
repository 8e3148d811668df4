"""Speculation keeps the target's distribution exactly (temperature > 0).

A fresh random tiny Gemma 4 with a 24-token vocabulary and a tiny assistant that mostly drafts the
token it is given: many seeded requests of one prompt each emit 3 tokens, the second of which is
decided by verifying a draft (kept when its row's draw equals it; else the row's draw, which is
then a draw from p without the draft). Its empirical distribution must match the target's marginal,
sum_t p(t | prompt) p(x | prompt, t), and how often it repeats the first token must match
sum_t p(t | prompt) p(t | prompt, t), by chi-square tests; the same tests reject a deliberately
broken sampler (a request drawing the same noise at every output position) on the same seeds. The marginal comes from our decoder run
alone (PagedSequence): transformers gives the same logits for text tokens but treats a sampled
image/audio placeholder id (8, 9, 12 here) as a media slot, which the engine does not.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import make_llm
from gemma4_fixtures import NUM_SPECIALS, PagedSequence, make_assistant, make_checkpoint, tiny_config
from test_engine_penalties import adjust

import mmserve.sample.sampler as sampler_module
from mmserve.engine.types import EngineRequest
from mmserve.model import load_model
from mmserve.request import Request
from mmserve.sample.penalties import PenaltyState
from mmserve.sampling_params import SamplingParams

VOCAB = NUM_SPECIALS + 8
TEMPERATURE = 1.3
N = 1000
BOUND = 0.01   # p-value; every seed is fixed, so the test is deterministic


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative_sampling")
    cfg = tiny_config(window=6, vocab=VOCAB)
    hf = make_checkpoint(root / "target", config=cfg, seed=61)
    make_assistant(root / "assistant", cfg, seed=63, copy_from=hf)
    return load_model(root / "target"), str(root / "assistant")


def target_joint(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """p(first token = t, second token = x) [t, x] under the target at TEMPERATURE, with `params`'
    penalties applied."""
    def probs(ids, output):
        logits = model.compute_logits(PagedSequence(model).step(ids)[-1:]).clone()
        adjust(logits, [Request("m", prompt, params, output_token_ids=output)], [], PenaltyState(capacity=64))
        return torch.softmax(logits[0] / TEMPERATURE, -1)
    nexts = torch.stack([probs(prompt + [t], [t]) for t in range(VOCAB)])
    return (probs(prompt, [])[:, None] * nexts).double()


def p_values(tokens: torch.Tensor, joint: torch.Tensor) -> tuple[float, float]:
    """Chi-square p-values of draws `tokens` [N, 2] (first and second tokens) against `joint`: of the
    second token's marginal, and of how often the second token repeats the first."""
    repeats = float((tokens[:, 0] == tokens[:, 1]).sum())
    p_repeat = float(joint.diagonal().sum())
    return (chi_square_p(torch.bincount(tokens[:, 1], minlength=VOCAB).double(), joint.sum(0)),
            chi_square_p(torch.tensor([repeats, len(tokens) - repeats]), torch.tensor([p_repeat, 1 - p_repeat])))


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts under probs (cells with expected count < 5 pooled)."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
    exp = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor(len(obs) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def second_tokens(model, assistant: str, prompt: list[int], penalties: dict, async_scheduling: str = "off"
                  ) -> tuple[torch.Tensor, list[int]]:
    llm = make_llm((model, None), speculative_model=assistant, num_speculative_tokens=2, max_num_seqs=64,
                   max_num_batched_tokens=256, num_kv_blocks=512, max_waiting_requests=N,
                   async_scheduling=async_scheduling)
    # Chunks padded to 1 + K rows, as with verify graphs: the second token's chunk holds one draft
    # (max_tokens 3 leaves room for one) and one pad position, which must never be sampled.
    llm.core.scheduler.verify_width = 3
    requests = [EngineRequest(f"s{i}", prompt, [], [],
                              SamplingParams(max_tokens=3, temperature=TEMPERATURE, seed=i, ignore_eos=True, **penalties))
                for i in range(N)]
    done = llm.generate(requests)
    return torch.tensor([c.token_ids[:2] for c in done]), llm.core.speculator.verified


# penalised: a prompt of two distinct tokens, so the repetition penalty singles them out
PENALTIES = {"plain": {}, "penalised": {"repetition_penalty": 2.0, "presence_penalty": 1.5}}


@pytest.mark.parametrize("loop", ["off", "on"])
@pytest.mark.parametrize("case", list(PENALTIES))
def test_speculative_sampling_matches_the_target_distribution(tiny_vocab, monkeypatch, case, loop):
    """`penalised`: each verify row's penalties count the drafts before it as output. Async scheduling
    (`loop` on): the drafts are made and verified on the device, the host sampling each verify row
    with drafts it learned with the step before's tokens."""
    model, assistant = tiny_vocab
    penalties = PENALTIES[case]
    prompt = torch.randint(NUM_SPECIALS, VOCAB, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    if penalties:
        prompt = [prompt[0], prompt[1]] * 4 + [prompt[0]]
    joint = target_joint(model, prompt, SamplingParams(temperature=TEMPERATURE, **penalties))
    tokens, verified = second_tokens(model, assistant, prompt, penalties, loop)
    assert verified[0] == N, "every request's second token goes through a verify step"
    p_exact = min(p_values(tokens, joint))
    assert p_exact > BOUND, f"speculative sampling departs from the target's distribution (p = {p_exact:.2g})"
    if case != "plain" or loop == "on":
        return
    position_seed = sampler_module.position_seed   # the bug: every position of a request draws the same noise
    monkeypatch.setattr(sampler_module, "position_seed", lambda seed, position: position_seed(seed, 0))
    biased, _ = second_tokens(model, assistant, prompt, penalties)
    p_biased = min(p_values(biased, joint))
    assert p_biased < BOUND, f"the test cannot tell a broken sampler apart (p = {p_biased:.2g})"


def test_rejection_sampling_under_a_grammar_keeps_the_masked_distribution(tmp_path, monkeypatch):
    """A constrained random request's verify chunk (real xgrammar, regex `[a-f][0-9]x`, two valid
    drafts): its first emitted token (the kept draft, or the draw that replaces it) must follow the
    target's first row under the grammar's mask, by the chi-square test over fixed seeds; draws that
    skip the mask fail the same test (seeds fixed)."""
    import gemma4_fixtures
    from engine_helpers import tiny_grammar

    from mmserve.core.sched.output import ScheduledRequest
    from mmserve.sample.sampler import Sampler
    from mmserve.sampling_params import ResponseFormat
    from mmserve.spec_decode.verify import verify_rows

    grammar, tokenizer, vocab = tiny_grammar(tmp_path)
    fmt = ResponseFormat("regex", "[a-f][0-9]x")
    grammar.add("r", fmt, grammar.compiler.compile(fmt))
    ids = {ch: tokenizer.encode(ch)[0] for ch in "abcdef5"}
    drafts = [ids["c"], ids["5"]]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(7))
    logits[0, [ids[ch] for ch in "abcdef"]] += 3.0   # row 0's allowed tokens carry most of its unmasked mass too
    allowed = torch.full((vocab,), float("-inf"))
    allowed[[ids[ch] for ch in "abcdef"]] = 0.0
    expected = torch.softmax(logits[0] + allowed, -1).double()
    request = Request("r", [gemma4_fixtures.BOS], SamplingParams(max_tokens=5, temperature=1.0, response_format=fmt))
    rows = verify_rows([ScheduledRequest(request, 3, 0, False, draft_token_ids=drafts)])

    def first_tokens() -> torch.Tensor:
        # the first emitted token is row 0's draw whether it keeps the first draft (equal to it) or not
        firsts = [Sampler(seed, grammar=grammar).sample(logits, rows).token_ids[0] for seed in range(N)]
        return torch.bincount(torch.tensor(firsts), minlength=vocab).double()

    counts = first_tokens()
    assert counts[ids["c"]] < N and set(torch.nonzero(counts).flatten().tolist()) <= {ids[ch] for ch in "abcdef"}
    p_exact = chi_square_p(counts, expected)
    assert p_exact > BOUND, f"rejection sampling under a grammar departs from the masked distribution (p = {p_exact:.2g})"
    monkeypatch.setattr(sampler_module, "apply_bitmask", lambda logits, bitmask, rows: None)
    p_biased = chi_square_p(first_tokens(), expected)
    assert p_biased < BOUND, f"the test cannot tell draws without the mask apart (p = {p_biased:.2g})"
