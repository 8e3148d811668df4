"""Sampling and stopping: filters against hand-derived sets, seeded draws independent of the batch,
stop strings on detokenized text, EOS, max_tokens."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import build_request, make_llm

from mmserve.errors import InvalidInputError
from mmserve.request import Request
from mmserve.sample.sampler import Sampler, filter_logits
from mmserve.sampling_params import SamplingParams


def rows(ids: list[str], params: list[SamplingParams]) -> list[Request]:
    return [Request(i, [1], p) for i, p in zip(ids, params, strict=True)]


def draw(sampler: Sampler, logits: torch.Tensor, ids: list[str], params: list[SamplingParams]) -> list[int]:
    return sampler.sample(logits, rows(ids, params)).token_ids


def test_top_k_and_top_p_keep_the_hand_derived_sets():
    logits = torch.randn(50)
    order = torch.argsort(logits, descending=True)
    def keep(top_k, top_p):
        return torch.isfinite(filter_logits(logits[None], torch.tensor([top_k]), torch.tensor([top_p])))[0]

    kept = keep(7, 1.0)
    assert set(torch.nonzero(kept).flatten().tolist()) == set(order[:7].tolist())
    probs = torch.softmax(logits, -1)
    top_p = 0.6
    # smallest prefix of the sorted tokens whose mass reaches top_p
    mass, n = 0.0, 0
    while mass < top_p:
        mass += probs[order[n]].item()
        n += 1
    kept = keep(0, top_p)
    assert set(torch.nonzero(kept).flatten().tolist()) == set(order[:n].tolist())


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
    """Fault injection (no real input makes the sampler raise for one request): its generator raises
    for one request id. That request ends with an error naming only itself; its greedy step-mate
    gets its solo run's tokens."""
    from mmserve.errors import EngineInternalError

    llm = make_llm(load_backend("reference"))
    mate = build_request("mate", [20], seed=3, max_tokens=6, temperature=0.0)
    alone = llm.generate([mate])[0].token_ids
    generator = llm.core.sampler.generator

    def failing(request_id, params, device):
        if request_id == "doomed":
            raise RuntimeError("injected: doomed and mate share this step")
        return generator(request_id, params, device)

    llm.core.sampler.generator = failing
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
