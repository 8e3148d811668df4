"""Our assistant drafter against transformers' Gemma4AssistantForCausalLM, from the same target states.

A tiny random target runs a prompt longer than both sliding windows (transformers and ours over a
paged cache with shuffled blocks); each drafter then drafts K tokens from it as transformers'
candidate generator does (target embedding of the last token + the last hidden state, constant
position, post-projected state into the next step). Ours reads the target's K/V in place through
the target's attention backend (the engine's `TargetKVReader`: the attend-only call, a round's
decode-shaped metadata), SDPA as CPU serving runs it and the dense reference. Every step's logits
must agree (fp32, 1e-4), for the plain tied head and the centroid (ordered-embedding) head.
"""

from __future__ import annotations

import pytest
import torch
from gemma4_fixtures import PagedSequence, make_assistant, make_checkpoint, runner_tables, tiny_config
from safetensors.torch import load_file, save_file

from mmserve.model import load_model
from mmserve.model.assistant import load_assistant
from mmserve.model.assistant_spec import check_compatible, load_assistant_spec, storing_layers
from mmserve.model.spec import UnsupportedModelError
from mmserve.model.weights import WeightLoadError
from mmserve.spec_decode.speculator import TargetKVReader

NUM_DRAFTS = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    cfg = tiny_config(window=6)
    path = tmp_path_factory.mktemp("target")
    return cfg, path, make_checkpoint(path, config=cfg, seed=11)


def hf_drafts(hf_target, hf_assistant, ids: torch.Tensor, first_token: int) -> list[torch.Tensor]:
    """transformers' drafting round right after prefill (Gemma4AssistantCandidateGenerator's loop)."""
    with torch.no_grad():
        out = hf_target(input_ids=ids[None], return_shared_kv_states=True, output_hidden_states=True,
                        use_cache=False)
        shared = out.shared_kv_states
        hidden = out.hidden_states[-1][:, -1:]
        token = torch.tensor([[first_token]])
        position = torch.tensor([[ids.numel()]])
        mask = torch.ones(1, ids.numel() + 1, dtype=torch.long)
        logits = []
        for _ in range(NUM_DRAFTS):
            embeds = torch.cat([hf_target.get_input_embeddings()(token), hidden], dim=-1)
            step = hf_assistant(inputs_embeds=embeds, attention_mask=mask, position_ids=position,
                                shared_kv_states=shared, use_cache=False)
            logits.append(step.logits[0, 0])
            token, hidden = step.logits.argmax(-1), step.last_hidden_state
    return logits


def our_drafts(model, assistant, ids: torch.Tensor, first_token: int, backend: str) -> list[torch.Tensor]:
    """The target's prefill on the dense reference (transformers' own arithmetic: its hidden states are
    transformers' bit for bit), then the drafter's attention on `backend` (the engine's drafter takes
    the target's backend of each layer type, as the runner's self-check left it)."""
    seq = PagedSequence(model, block_size=4, num_blocks=32, seed=5)
    hidden = seq.step(ids.tolist())[-1:]
    model.attention_backends = dict.fromkeys(model.attention_backends, backend)
    n = ids.numel()
    tables = runner_tables(storing_layers(model.spec), {"seq": seq.blocks.tolist()}, len(seq.blocks))
    target_kv = TargetKVReader(assistant, model, max_num_seqs=4).prepare([n], tables, tables.rows_of(["seq"]),
                                                                         seq.block_size, seq.kv_caches)
    return draft_logits(model, assistant, target_kv, hidden, n, first_token)


def draft_logits(model, assistant, target_kv: dict, hidden: torch.Tensor, n: int, first_token: int
                 ) -> list[torch.Tensor]:
    """Each draft step's logits, from the target's last hidden state and its `n` keys (`target_kv`)."""
    rope = assistant.rope(torch.tensor([n]), torch.float32)
    token = torch.tensor([first_token])
    logits = []
    for _ in range(NUM_DRAFTS):
        embeds = model.decoder.embed(token, None, None)
        step_logits, hidden = assistant.step(embeds, hidden, rope, target_kv)
        logits.append(step_logits[0])
        token = step_logits.argmax(-1)
    return logits


@pytest.mark.parametrize(("ordered", "backend"), [(False, "sdpa"), (True, "reference")],
                         ids=["lm_head-sdpa", "centroids-reference"])
def test_draft_logits_match_transformers(target, tmp_path, ordered, backend):
    cfg, path, hf_target = target
    hf_assistant = make_assistant(tmp_path / "assistant", cfg, seed=21 + ordered, ordered=ordered)
    model = load_model(path)
    assistant = load_assistant(tmp_path / "assistant", model.spec, dtype=torch.float32, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(7 + ordered)
    ids = torch.randint(16, cfg["text_config"]["vocab_size"], (19,), generator=gen)   # > both windows + 1
    first = int(torch.randint(16, 300, (1,), generator=gen))
    theirs, ours = hf_drafts(hf_target, hf_assistant, ids, first), our_drafts(model, assistant, ids, first, backend)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, i=i: f"draft step {i}: {m}")
    # the drafts are not degenerate: the window and the steps change what the drafter sees
    assert len({int(x.argmax()) for x in ours}) > 1 or ordered


def test_a_mismatched_assistant_is_refused_naming_the_mismatch(target, tmp_path):
    cfg, path, _ = target
    spec = load_model(path).spec
    make_assistant(tmp_path / "wide", cfg, head_dim=8)
    with pytest.raises(UnsupportedModelError, match="sliding_attention: head_dim/kv heads 8/2"):
        check_compatible(load_assistant_spec(tmp_path / "wide"), spec)
    other = dict(cfg, text_config=dict(cfg["text_config"], hidden_size=64))
    make_assistant(tmp_path / "narrow", other)
    with pytest.raises(UnsupportedModelError, match="backbone_hidden_size 64 != the target's hidden_size 72"):
        check_compatible(load_assistant_spec(tmp_path / "narrow"), spec)
    with pytest.raises(UnsupportedModelError, match="model_type='gemma4'"):
        load_assistant_spec(path)
    make_assistant(tmp_path / "int8", cfg)   # quantized: a cast loaded it silently as wrong values
    tensors = load_file(str(tmp_path / "int8" / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"].to(torch.int8)
    save_file(tensors, str(tmp_path / "int8" / "model.safetensors"))
    with pytest.raises(WeightLoadError, match="model.layers.0.self_attn.q_proj.weight is torch.int8, expected"):
        load_assistant(tmp_path / "int8", spec, dtype=torch.float32, device=torch.device("cpu"))


def test_a_round_reads_its_requests_runner_rows_as_rows_are_reused(target, tmp_path):
    """The reader's tables are gathered from the runner's by request row: across rounds in which
    requests end and others take their rows (shorter tables than the rows' last holders), padding
    requests and more or fewer requests than the round before, each of a round's rows is its own
    request's blocks and then the null block, every padding row the null block alone."""
    cfg, path, _ = target
    make_assistant(tmp_path / "assistant", cfg, seed=3)
    model = load_model(path)
    assistant = load_assistant(tmp_path / "assistant", model.spec, dtype=torch.float32, device=torch.device("cpu"))
    seq = PagedSequence(model, block_size=4, num_blocks=32, seed=5)
    reader = TargetKVReader(assistant, model, max_num_seqs=4)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    blocks = seq.blocks.tolist()

    def some_blocks() -> list[int]:
        start, n = (int(x) for x in torch.randint(0, 16, (2,), generator=gen))
        return blocks[start:start + n + 1]

    tables, held, rows_seen = None, {}, {}
    for step in range(6):
        ended = [rid for rid in held if torch.rand((), generator=gen) < 0.5]
        for rid in ended:   # as the next step's execute frees them
            tables.free(rid)
            del held[rid]
        admitted = int(torch.randint(0 if held else 1, 4 - len(held) + 1, (), generator=gen))
        new = {f"r{step}-{i}": some_blocks() for i in range(admitted)}
        held.update(new)
        tables = runner_tables(storing_layers(model.spec), new, len(blocks), into=tables)
        ids = [rid for rid in held if torch.rand((), generator=gen) < 0.7] or list(held)
        rows = tables.rows_of(ids)
        for rid, row in zip(ids, rows.tolist(), strict=True):
            rows_seen.setdefault(row, set()).add(rid)
        num_keys = [4 * len(held[rid]) for rid in ids] + [1] * int(torch.randint(0, 4 - len(ids) + 1, (), generator=gen))
        for kv in reader.prepare(num_keys, tables, rows, seq.block_size, seq.kv_caches).values():
            got = kv.metadata.common.block_table_cpu
            for r, rid in enumerate(ids):
                assert got[r].tolist() == held[rid] + [0] * (got.shape[1] - len(held[rid])), (step, rid)
            assert not got[len(ids):].any(), step
    assert any(len(ids) > 1 for ids in rows_seen.values()), "no row was reused: the test proves little"


def test_a_reader_drafts_over_a_larger_cache_as_a_fresh_one_does(target, tmp_path):
    """On CUDA a drafter's first round is the memory profile's, over the profiling runner's small
    pools, and serving's rounds read the larger serving pools. Flex sizes its metadata (block mask,
    logical blocks) by the pool: a reader that kept its first round's builders indexed the larger
    cache's blocks out of them (IndexError). Its builders now follow the cache it reads: after a round
    over a 16-block cache, it drafts over a 64-block one exactly as a fresh reader does. (The first
    round only prepares its metadata, where the builder is made: one flex compile per layer type.)"""
    cfg, path, _ = target
    make_assistant(tmp_path / "assistant", cfg, seed=int(torch.randint(0, 1000, ())))
    model = load_model(path)
    assistant = load_assistant(tmp_path / "assistant", model.spec, dtype=torch.float32, device=torch.device("cpu"))
    ids = torch.randint(16, cfg["text_config"]["vocab_size"], (19,)).tolist()
    small, large = (PagedSequence(model, block_size=4, num_blocks=n, seed=int(torch.randint(0, 1000, ())))
                    for n in (16, 64))
    hidden = large.step(ids)[-1:]   # (the small cache's contents never matter: its round only prepares)
    model.attention_backends = dict.fromkeys(model.attention_backends, "flex")
    width = large.num_blocks - 1   # the runner's: one max_model_len for both
    first = int(torch.randint(16, 300, ()))

    def round_over(reader: TargetKVReader, seq: PagedSequence) -> dict:
        tables = runner_tables(storing_layers(model.spec), {"seq": seq.blocks.tolist()}, width)
        return reader.prepare([len(ids)], tables, tables.rows_of(["seq"]), seq.block_size, seq.kv_caches)

    def drafts(reader: TargetKVReader) -> list[torch.Tensor]:
        return draft_logits(model, assistant, round_over(reader, large), hidden, len(ids), first)

    reused = TargetKVReader(assistant, model, max_num_seqs=4)
    round_over(reused, small)
    want = drafts(TargetKVReader(assistant, model, max_num_seqs=4))
    for a, b in zip(drafts(reused), want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
