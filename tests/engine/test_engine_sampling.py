"""Sampling and stopping: the sort-free filters against a sort-based reference and draws against the
reference distribution (chi-square), seeded draws independent of the batch, stop strings on
detokenized text, EOS, max_tokens."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import build_request, make_llm
from test_engine_speculative_sampling import chi_square_p

from mmserve.errors import InvalidInputError
from mmserve.request import Request
from mmserve.sample.sampler import Sampler, filtered_probs
from mmserve.sampling_params import SamplingParams


def rows(ids: list[str], params: list[SamplingParams]) -> list[Request]:
    return [Request(i, [1], p) for i, p in zip(ids, params, strict=True)]


def draw(sampler: Sampler, logits: torch.Tensor, ids: list[str], params: list[SamplingParams]) -> list[int]:
    return sampler.sample(logits, rows(ids, params)).token_ids


def sorted_reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row's sampling distribution by the definition, with a full sort in float64: softmax of
    logits / T, top-k (ties with the k-th stay), renormalised, then the nucleus: the tokens the mass
    strictly above which is below top_p (the smallest top set reaching top_p; ties at its edge stay)."""
    scaled = logits.double() / p.temperature
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if 0 < p.top_k < len(scaled):
        keep &= scaled >= torch.topk(scaled, p.top_k).values[-1]
    probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), -1)
    if p.top_p < 1.0:
        above = torch.stack([probs[probs > x].sum() for x in probs])
        probs = probs * (above < p.top_p)
    return probs / probs.sum()


def random_params(gen: torch.Generator, vocab: int) -> SamplingParams:
    pick = torch.rand(3, generator=gen).tolist()
    return SamplingParams(temperature=0.3 + 1.5 * pick[0],
                          top_k=int(torch.randint(1, vocab + 8, (), generator=gen)) if pick[1] < 0.6 else 0,
                          top_p=0.05 + 0.9 * pick[2] if pick[2] < 0.7 else 1.0)


def test_sort_free_filters_keep_the_sorted_reference_sets():
    """Fresh random rows (some with tied logits) and filters: the kept sets equal the sort-based ones."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    vocab = 300
    logits = torch.randn(64, vocab, generator=gen) * 3
    logits[::4, 1:20] = logits[::4, :1]   # ties, some at the k-th or the nucleus' edge
    params = [random_params(gen, vocab) for _ in range(64)]
    got = filtered_probs(logits, params) > 0
    want = torch.stack([sorted_reference(row, p) > 0 for row, p in zip(logits, params, strict=True)])
    assert torch.equal(got, want), [p for p, g, w in zip(params, got, want, strict=True) if not torch.equal(g, w)][:3]


def test_top_k_top_p_draws_follow_the_reference_distribution(monkeypatch):
    """4000 unseeded draws (one batched generator) of one row under top-k + top-p follow the
    sort-based reference distribution by a chi-square test; the same test rejects draws that skip
    the nucleus (seeds fixed: p = 0.38 exact, 2e-30 without top-p)."""
    vocab, n = 40, 4000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) * 2
    p = SamplingParams(temperature=1.2, top_k=12, top_p=0.8)
    expected = sorted_reference(logits[0], p)

    def counts() -> torch.Tensor:
        out = Sampler(seed=1).sample(logits.expand(n, vocab), rows([f"r{i}" for i in range(n)], [p] * n))
        return torch.bincount(torch.tensor(out.token_ids), minlength=vocab).double()

    assert chi_square_p(counts(), expected) > 0.01
    import mmserve.sample.sampler as sampler_module
    monkeypatch.setattr(sampler_module, "nucleus", lambda probs, top_p: torch.ones_like(probs, dtype=torch.bool))
    assert chi_square_p(counts(), expected) < 0.01


def test_seeded_draws_do_not_depend_on_the_batch():
    logits = torch.randn(6, 40)
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=123)
    alone = draw(Sampler(), logits[:1], ["a"], [p])[0]
    batch_a = draw(Sampler(seed=1), logits[:3], ["a", "x", "y"], [p, SamplingParams(temperature=1.0), p])
    batch_b = draw(Sampler(seed=2), logits[[0, 4]], ["a", "z"], [p, SamplingParams(temperature=2.0)])
    assert batch_a[0] == batch_b[0] == alone
    # a draw follows the distribution: tokens far outside the nucleus never come out
    s = Sampler(seed=5)
    draws = [draw(s, logits[:1], [f"r{i}"], [SamplingParams(temperature=1.0, top_k=3)])[0] for i in range(200)]
    assert set(draws) <= set(torch.topk(logits[0], 3).indices.tolist())
    assert len(set(draws)) > 1


def test_mixed_greedy_and_seeded_rows_each_match_their_row_sampled_alone():
    logits = torch.randn(5, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=11),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_k=5, seed=12),
              SamplingParams(temperature=0.9, top_p=0.8, seed=13)]
    ids = [f"m{i}" for i in range(5)]
    batch = draw(Sampler(), logits, ids, params)
    alone = [draw(Sampler(), logits[i:i + 1], [ids[i]], [params[i]])[0] for i in range(5)]
    assert batch == alone
    assert batch[0] == int(logits[0].argmax()) and batch[2] == int(logits[2].argmax())


def test_invalid_sampling_params_are_rejected():
    for kw in [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2), dict(stop=("",))]:
        with pytest.raises(InvalidInputError):
            SamplingParams(**kw)


def test_stop_string_eos_and_length(load_backend):
    model_tok = load_backend("reference")
    req = build_request("s", [25], seed=11, max_tokens=24)
    full = make_llm(model_tok).generate([req])[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 24
    assert full.text == model_tok[1].decode(full.token_ids)
    # a two-character stop string taken from the middle of the greedy text
    start = next(i for i in range(len(full.text) // 3, len(full.text) - 2)
                 if "\ufffd" not in full.text[i:i + 2] and full.text[i:i + 2].strip())
    stop = full.text[start:start + 2]
    req_stop = build_request("s", [25], seed=11, max_tokens=24, stop=("never-there", stop))
    got = make_llm(model_tok).generate([req_stop])[0]
    assert got.finish_reason == "stop" and got.matched_stop == stop
    assert got.text == full.text[:full.text.index(stop)]
    assert got.token_ids == full.token_ids[:len(got.token_ids)]
    # EOS: make the 5th greedy token an end-of-sequence id; ignore_eos keeps going
    llm = make_llm(model_tok)
    llm.core.eos_token_ids = frozenset({full.token_ids[4]})
    first = full.token_ids.index(full.token_ids[4])
    eos = llm.generate([build_request("e", [25], seed=11, max_tokens=24)], SamplingParams(max_tokens=24))[0]
    assert eos.finish_reason == "eos" and eos.token_ids == full.token_ids[:first + 1]
    kept = llm.generate([build_request("e", [25], seed=11, max_tokens=24)],
                        SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert kept.token_ids == full.token_ids


def test_streamed_text_never_shows_a_stop_string(load_backend):
    model_tok = load_backend("reference")
    full = make_llm(model_tok).generate([build_request("t", [30], seed=12, max_tokens=30)])[0]
    text = full.text
    start = next(i for i in range(len(text) // 2, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    stop = text[start:start + 3]
    llm = make_llm(model_tok)
    llm.add_request(build_request("t", [30], seed=12, max_tokens=30, stop=(stop,)))
    deltas = []
    while llm.has_work:
        deltas += [o.new_text for _, o in llm.step()]
    assert stop not in "".join(deltas) and "".join(deltas) == text[:text.index(stop)]


def test_a_request_whose_sampling_fails_ends_alone(load_backend):
    """Fault injection (no real input makes the sampler raise for one request): its draw raises
    for one request id. That request ends with an error naming only itself; its greedy step-mate
    gets its solo run's tokens."""
    from mmserve.errors import EngineInternalError

    llm = make_llm(load_backend("reference"))
    mate = build_request("mate", [20], seed=3, max_tokens=6, temperature=0.0)
    alone = llm.generate([mate])[0].token_ids
    draw_rows = llm.core.sampler._draw

    def failing(logits, requests):
        if any(r.request_id == "doomed" for r in requests):
            raise RuntimeError("injected: doomed and mate share this step")
        return draw_rows(logits, requests)

    llm.core.sampler._draw = failing
    llm.add_request(mate)
    llm.add_request(build_request("doomed", [20], seed=4, max_tokens=6, temperature=1.0))
    tokens, errors = [], {}
    while llm.has_work:
        for rid, item in llm.step():
            if isinstance(item, BaseException):
                errors[rid] = item
            elif rid == "mate":
                tokens += item.new_token_ids
    assert list(errors) == ["doomed"] and isinstance(errors["doomed"], EngineInternalError)
    assert "mate" not in str(errors["doomed"])
    assert tokens == alone
