"""The embedded demo model: transformers loads it and captions held-out clips; our server, fed the
same videos over gRPC, gives the same greedy tokens; a deliberately broken pipeline scores lower."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer
from transformers import Gemma4ForConditionalGeneration

from mmserve import cli
from mmserve.clients.eval_demo import eval_offline, eval_server, held_out_seeds, score
from mmserve.config import DEMO_MODEL_DIR
from mmserve.multimodal import demo_task
from mmserve.multimodal.demo_task import VisionParams

SEEDS = held_out_seeds(20)


@pytest.fixture(scope="session")
def hf_model() -> Gemma4ForConditionalGeneration:
    assert (DEMO_MODEL_DIR / "model.safetensors").is_file(), "the demo checkpoint is missing"
    return Gemma4ForConditionalGeneration.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))


@pytest.fixture(scope="session")
def vision() -> VisionParams:
    video = json.loads((DEMO_MODEL_DIR / "video_preprocessor_config.json").read_text())
    return VisionParams(video["patch_size"], video["pooling_kernel_size"], video["max_soft_tokens"])


@pytest.fixture(scope="session")
def hf_answers(hf_model, tokenizer, vision) -> list[list[int]]:
    """transformers' greedy answer ids for SEEDS (end-of-turn ids dropped), video first as the client sends."""
    eos = set(hf_model.generation_config.eos_token_id)
    answers = []
    with torch.no_grad():
        for seed in SEEDS:
            data, _ = demo_task.clip_for(seed)
            ref = demo_task.reference_inputs(tokenizer, data, vision, video_first=True)
            out = hf_model.generate(**ref.as_kwargs(), max_new_tokens=32, do_sample=False)
            answers.append([t for t in out[0, ref.input_ids.shape[1]:].tolist() if t not in eos])
    return answers


def test_checkpoint_is_a_hybrid_gemma4(hf_model, tokenizer, vision) -> None:
    text = hf_model.config.get_text_config()
    assert text.use_bidirectional_attention == "vision" and text.attention_k_eq_v
    assert {"sliding_attention", "full_attention"} <= set(text.layer_types)
    sliding = hf_model.model.language_model.layers[text.layer_types.index("sliding_attention")].self_attn
    full = hf_model.model.language_model.layers[text.layer_types.index("full_attention")].self_attn
    assert sliding.head_dim < full.head_dim
    data, _ = demo_task.clip_for(SEEDS[0])
    prompt_len = demo_task.reference_inputs(tokenizer, data, vision).input_ids.shape[1]
    assert text.sliding_window < prompt_len  # the window really slides over the prompt
    eot = tokenizer.token_to_id("<turn|>")
    assert eot in hf_model.generation_config.eos_token_id


def test_transformers_captions_held_out_clips(hf_answers, tokenizer) -> None:
    truths = [demo_task.clip_for(s)[1] for s in SEEDS]
    result = score(SEEDS, [tokenizer.decode(a) for a in hf_answers], truths)
    assert result.accuracy >= 0.9, result.misses


def test_server_prompt_equals_training_prompt(tokenizer, vision) -> None:
    """model.prompt (what the server feeds the model) builds the very ids the model was trained on."""
    from mmserve.model.messages import ChatMessage, TextPart, VideoPart
    from mmserve.model.prompt import build_prompt
    from mmserve.model.spec import load_spec
    from mmserve.model.tokenizer import load_tokenizer
    from mmserve.multimodal.limits import MediaLimits
    from mmserve.multimodal.preprocess import preprocess_images
    from mmserve.multimodal.video import decode_video

    data, _ = demo_task.clip_for(SEEDS[1])
    video = decode_video(data, num_frames=demo_task.NUM_FRAMES, limits=MediaLimits())
    batch = preprocess_images(video.frames, patch_size=vision.patch_size,
                              pooling_kernel_size=vision.pooling_kernel_size, max_soft_tokens=vision.max_soft_tokens)
    part = VideoPart(batch.pixel_values, batch.position_ids, batch.num_soft_tokens, video.timestamps_s)
    for video_first in (True, False):
        parts = [part, TextPart(demo_task.PROMPT)] if video_first else [TextPart(demo_task.PROMPT), part]
        layout = build_prompt(load_tokenizer(DEMO_MODEL_DIR), load_spec(DEMO_MODEL_DIR), [ChatMessage("user", parts)])
        ref = demo_task.reference_inputs(tokenizer, data, vision, video_first=video_first)
        assert layout.token_ids == ref.input_ids[0].tolist()
        soft = (ref.mm_token_type_ids[0] == 2).nonzero().flatten().tolist()
        assert [i for s, e in layout.mm_ranges for i in range(s, e + 1)] == soft


def test_served_captions_equal_transformers(mmserve_server, hf_answers, tokenizer) -> None:
    result, token_ids = eval_server(mmserve_server.address, SEEDS, concurrency=4)
    assert result.accuracy >= 0.9, result.misses
    eos = {tokenizer.token_to_id("<turn|>"), tokenizer.token_to_id("<eos>")}
    assert [[t for t in ids if t not in eos] for ids in token_ids] == hf_answers


def test_demo_cli(mmserve_server, capsys) -> None:
    assert cli.main(["demo", "--server", mmserve_server.address, "--seed", str(SEEDS[2])]) == 0
    out = capsys.readouterr().out
    assert f"truth  {demo_task.clip_for(SEEDS[2])[1]}" in out
    assert "\nMATCH" in out


def test_demo_cli_json_answers_in_the_caption_schema(mmserve_server, capsys) -> None:
    assert cli.main(["demo", "--server", mmserve_server.address, "--seed", str(SEEDS[3]), "--json"]) == 0
    out = capsys.readouterr().out
    answer = out.split("model  ", 1)[1].split("\n", 1)[0]
    assert set(json.loads(answer)) == {"shape", "color", "direction"}
    assert "valid against the schema" in out and "INVALID" not in out


@pytest.mark.slow
def test_broken_pipelines_score_lower() -> None:
    """The accuracy check has teeth: each deliberate bug costs clearly more than noise on 60 clips.
    (On 200 clips: intact 98.5%, causal frames 83%, earlier frames hidden 44.5%, reversed 0%.)"""
    seeds = held_out_seeds(60)
    options = dict(device="cpu", attention_backend="reference", max_num_batched_tokens=512, kv_cache_bytes=16 * 2**20)
    good = eval_offline(str(DEMO_MODEL_DIR), seeds, **options).accuracy
    assert good >= 0.9
    for how, drop in (("causal-frames", 0.08), ("hide-earlier-frames", 0.3), ("reversed-frames", 0.5)):
        broken = eval_offline(str(DEMO_MODEL_DIR), seeds, how=how, **options).accuracy
        assert broken <= good - drop, (how, good, broken)


def test_eval_demo_cli(mmserve_server, capsys) -> None:
    assert cli.main(["eval-demo", "--server", mmserve_server.address, "--n", "4"]) == 0
    assert "exact match" in capsys.readouterr().out
