"""Sampling and stopping: the sort-free filters against a sort-based reference and draws against the
reference distribution (chi-square), seeded draws independent of the batch, stop strings on
detokenized text, EOS, max_tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import build_request, make_llm
from test_engine_speculative_sampling import chi_square_p
from torch.utils._python_dispatch import TorchDispatchMode

import mmserve.sample.nucleus as nucleus_module
import mmserve.sample.row_values as row_values_module
import mmserve.sample.sampler as sampler_module
from mmserve.errors import InvalidInputError
from mmserve.request import Request
from mmserve.sample.row_values import RowValues
from mmserve.sample.sampler import Draws, Sampler, inverse_cdf
from mmserve.sampling_params import SamplingParams


def rows(ids: list[str], params: list[SamplingParams]) -> list[Request]:
    return [Request(i, [1], p) for i, p in zip(ids, params, strict=True)]


def draw(sampler: Sampler, logits: torch.Tensor, ids: list[str], params: list[SamplingParams]) -> list[int]:
    return sampler.sample(logits, rows(ids, params)).token_ids


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The sampler's filtered distribution of each row (`Draws`), planned and sent as a step does."""
    values = RowValues()
    draws = Draws(values, rows([f"f{i}" for i in range(len(params))], params), logits.shape[-1])
    return draws.filtered_probs(logits, values.to(logits.device))


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
    monkeypatch.setattr(nucleus_module, "nucleus", lambda probs, top_p: torch.ones_like(probs, dtype=torch.bool))
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
    for kw in [dict(max_tokens=0), dict(temperature=-1), dict(temperature=float("inf")), dict(temperature=float("nan")),
               dict(top_p=0.0), dict(top_k=-2), dict(stop=("",))]:
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


def test_a_stop_string_inside_a_step_of_several_tokens_keeps_their_logprobs_alone():
    """A step may bring several tokens (speculation's accepted drafts); a stop string met at the
    second ends the request there, and the logprobs reported are those of the tokens kept."""
    from mmserve.engine.output.request_state import RequestState
    from mmserve.ipc.protocol import CoreOutput, TokenLogprobs

    class Letters:   # a detokenizer: token t is the letter chr(ord('a') + t)
        def push(self, ids):
            return "".join(chr(97 + t) for t in ids)

        def flush(self):
            return ""

    state = RequestState(Request("r", [1, 2], SamplingParams(max_tokens=10, stop=("b",), logprobs=True)), 0, Letters())
    step = [TokenLogprobs(t, -0.1 * (t + 1), 1) for t in (0, 1, 2)]
    out = state.append(CoreOutput("r", [0, 1, 2], None, step, 0))   # "abc": a step that accepted two drafts
    assert out.finished and out.finish_reason == "stop" and out.new_text == "a"
    assert out.new_token_ids == [0, 1] and out.new_logprobs == step[:2] and state.logprobs == step[:2]


def test_a_request_whose_sampling_fails_ends_alone(load_backend):
    """Fault injection (no real input makes the sampler raise for one request): its draw raises
    for one request id. That request ends with an error naming only itself; its greedy step-mate
    gets its solo run's tokens."""
    from mmserve.errors import EngineInternalError

    llm = make_llm(load_backend("reference"))
    mate = build_request("mate", [20], seed=3, max_tokens=6, temperature=0.0)
    alone = llm.generate([mate])[0].token_ids
    draw_rows = llm.core.sampler._draw

    def failing(logits, draws, dev):
        if any(r.request_id == "doomed" for r in draws.requests):
            raise RuntimeError("injected: doomed and mate share this step")
        return draw_rows(logits, draws, dev)

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


TO_DEVICE = row_values_module.to_device


class DeviceWork(TorchDispatchMode):
    """What queuing a step's sampling launches: tensor ops that are not views (one kernel each on
    CUDA, ~1-2 us of device time even in a graph), and host-to-device copies of per-row values."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.ops, self.copies, self.active = 0, 0, False

        def counted(*args, **kwargs):
            self.copies += self.active
            return TO_DEVICE(*args, **kwargs)
        monkeypatch.setattr(row_values_module, "to_device", counted)

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


def step_work(monkeypatch, params: list[SamplingParams], gen: torch.Generator, steps: int = 2) -> DeviceWork:
    """The device work of the last of `steps` steps of rows with `params` (earlier steps grow the
    penalties' state, so the last one adds new output tokens as a steady decode does)."""
    vocab = 96
    requests = [Request(f"w{i}", torch.randint(0, vocab, (5,), generator=gen).tolist(), p,
                        output_token_ids=torch.randint(0, vocab, (3,), generator=gen).tolist())
                for i, p in enumerate(params)]
    sampler = Sampler(seed=1, eos_token_ids=[2])
    for step in range(steps):
        logits = torch.randn(len(requests), vocab, generator=gen)
        if step == steps - 1:
            work = DeviceWork(monkeypatch)
            with work:
                pending = sampler.launch(logits, requests)
        else:
            pending = sampler.launch(logits, requests)
        for r, t in zip(requests, pending.result().token_ids, strict=True):
            r.output_token_ids.append(t)
    return work


def real_traffic(i: int, gen: torch.Generator) -> SamplingParams:
    """Row i of a batch as OpenAI clients send them: temperature 1.0, many seeded, some penalised,
    some with logprobs, top-k/top-p, bias, min_tokens."""
    pick = torch.rand(4, generator=gen).tolist()
    return SamplingParams(temperature=1.0, seed=int(torch.randint(0, 2**31, (), generator=gen)) if pick[0] < 0.5 else None,
                          presence_penalty=0.5 if pick[1] < 0.4 else 0.0, repetition_penalty=1.2 if pick[1] < 0.2 else 1.0,
                          logprobs=pick[2] < 0.3, top_logprobs=3 if pick[2] < 0.3 else 0,
                          top_k=40 if pick[3] < 0.3 else 0, top_p=0.9 if pick[3] < 0.5 else 1.0,
                          logit_bias=((7, 2.0),) if i % 5 == 0 else (), min_tokens=6 if i % 7 == 0 else 0)


@pytest.mark.parametrize("kind", ["seeded", "penalised", "real_traffic"])
def test_queuing_a_steps_sampling_does_not_grow_with_its_rows(monkeypatch, kind):
    """One packed copy of per-row values a step, and as many ops for 48 rows as for 4 (today's code
    copied per parameter and drew one noise kernel per seeded row and one count update per
    penalised row)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))

    def params(n: int) -> list[SamplingParams]:
        if kind == "seeded":
            return [SamplingParams(temperature=1.0, seed=100 + i) for i in range(n)]
        if kind == "penalised":
            return [SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
                    for _ in range(n)]
        return [real_traffic(i, gen) for i in range(n)]

    if kind == "real_traffic":   # every feature in both batches, so both take the same branches
        small = [real_traffic(i, gen) for i in range(40)]
        few = [p for p in small if p.seed is not None][:1] + [p for p in small if p.seed is None][:1] + [
            p for p in small if p.has_penalties and p.repetition_penalty != 1.0][:1] + [
            p for p in small if p.logprobs][:1] + [p for p in small if p.top_k][:1] + [
            p for p in small if p.top_p < 1.0][:1] + [small[0], small[7]]
        work_few, work_many = step_work(monkeypatch, few, gen), step_work(monkeypatch, few + params(40), gen)
    else:
        work_few, work_many = step_work(monkeypatch, params(4), gen), step_work(monkeypatch, params(48), gen)
    assert work_few.copies == work_many.copies == 1
    assert work_few.ops == work_many.ops, (work_few.ops, work_many.ops)


def test_seeded_tokens_do_not_depend_on_the_batch_or_its_order():
    """A seeded row's tokens over 12 steps are the same alone and in batches of other seeded and
    unseeded rows in shuffled orders."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    vocab, steps = 64, 12
    logits = torch.randn(steps, vocab, generator=gen) * 2
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=int(torch.randint(0, 2**31, (), generator=gen)))

    def run(mates: list[SamplingParams], order: torch.Tensor) -> list[int]:
        requests = [Request("target", [1], target)] + [Request(f"m{i}", [1], p) for i, p in enumerate(mates)]
        requests = [requests[i] for i in order.tolist()]
        sampler, tokens = Sampler(seed=int(torch.randint(0, 100, (), generator=gen))), []
        for step in range(steps):
            rows = logits[step].expand(len(requests), vocab) + torch.randn(len(requests), vocab, generator=gen) * (
                torch.tensor([r.request_id != "target" for r in requests]).unsqueeze(1))
            out = sampler.sample(rows, requests).token_ids
            for r, t in zip(requests, out, strict=True):
                r.output_token_ids.append(t)
            tokens.append(out[[r.request_id for r in requests].index("target")])
        return tokens

    alone = run([], torch.tensor([0]))
    for n in (3, 17):
        mates = [SamplingParams(temperature=0.7, seed=i if i % 2 else None) for i in range(n)]
        assert run(mates, torch.randperm(n + 1, generator=gen)) == alone
    assert len(set(alone)) > 1


def test_seeded_rows_follow_the_reference_distribution(monkeypatch):
    """4000 seeded rows in one step (each its own seed: one batched inverse CDF for all of them) under
    top-k + top-p follow the sort-based reference by a chi-square test; rows whose noise ignores
    their seed fail it (seeds fixed)."""
    vocab, n = 40, 4000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) * 2
    p = SamplingParams(temperature=1.2, top_k=12, top_p=0.8)
    expected = sorted_reference(logits[0], p)

    def counts() -> torch.Tensor:
        params = [dataclasses.replace(p, seed=1000 + i) for i in range(n)]
        out = Sampler(seed=1).sample(logits.expand(n, vocab), rows([f"s{i}" for i in range(n)], params))
        return torch.bincount(torch.tensor(out.token_ids), minlength=vocab).double()

    assert chi_square_p(counts(), expected) > 0.01
    position_seed = sampler_module.position_seed
    monkeypatch.setattr(sampler_module, "position_seed", lambda seed, position: position_seed(seed % 7, position))
    assert chi_square_p(counts(), expected) < 0.01


def test_inverse_cdf_picks_the_first_token_reaching_each_rows_uniform():
    """Fresh random rows with zero-mass tokens (filtered out) and random uniforms, extremes included:
    the token is the first whose float64 cumulative mass reaches u * total, and never a zero-mass one;
    a row of NaN (all masked) gets the last id, not one past the vocabulary."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    probs = torch.rand(64, 50, generator=gen) * (torch.rand(64, 50, generator=gen) < 0.3)
    probs[:, 49] = 0.0   # a zero-mass last token: the largest uniform must not fall through to it
    probs[torch.arange(64), torch.randint(0, 49, (64,), generator=gen)] += 0.01   # every row has mass
    bits = torch.randint(0, 2**52, (64,), generator=gen)
    bits[:2] = torch.tensor([0, 2**52 - 1])
    got = inverse_cdf(probs, bits)
    for row, b, token in zip(probs.double(), bits.tolist(), got.tolist(), strict=True):
        threshold = (b + 0.5) / 2**52 * float(row.sum())
        mass = 0.0
        want = next(i for i, p in enumerate(row.tolist()) if (mass := mass + p) >= threshold)
        assert token == want and row[token] > 0
    masked = torch.full((2, 50), float("nan"))   # softmax of a row with every token masked (a dead grammar's)
    assert inverse_cdf(masked, bits[:2]).tolist() == [49, 49]   # an id the logprob gather can read, never 50


def test_a_constrained_rows_mask_rides_the_steps_one_copy(tmp_path, monkeypatch):
    """A step with a grammar-constrained row (real xgrammar) among seeded and penalised rows: its
    bitmask goes to the device with the step's other values, in one copy, and masks the row."""
    import gemma4_fixtures
    from engine_helpers import tiny_grammar

    from mmserve.sampling_params import ResponseFormat

    grammar, tokenizer, vocab = tiny_grammar(tmp_path)
    fmt = ResponseFormat("regex", "[a-f][0-9]x")
    grammar.add("g", fmt, grammar.compiler.compile(fmt))
    requests = [Request("g", [gemma4_fixtures.BOS], SamplingParams(temperature=1.0, response_format=fmt)),
                Request("s", [gemma4_fixtures.BOS], SamplingParams(temperature=1.0, seed=3)),
                Request("p", [gemma4_fixtures.BOS], SamplingParams(temperature=1.0, presence_penalty=0.5))]
    work = DeviceWork(monkeypatch)
    with work:
        pending = Sampler(grammar=grammar).launch(torch.randn(3, vocab) * 3, requests)
    assert work.copies == 1
    assert tokenizer.decode([pending.result().token_ids[0]]) in set("abcdef")
