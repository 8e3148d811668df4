"""Checkpoint loading: sharded files with an index, legacy tensor names, text-only models as
transformers saves them (against its logits), strict missing/unexpected checks, and a tensor given
twice refused, naming both copies."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from gemma4_fixtures import (
    BOS,
    NUM_SPECIALS,
    VOCAB,
    PagedSequence,
    e_model_config,
    randomize_,
    tiny_config,
    unified_config,
)
from safetensors.torch import load_file, save_file
from test_model_parity import assert_close

from mmserve.model import load_model
from mmserve.model.weights import WeightLoadError, checkpoint_files

SMALL_FILES = ("config.json", "tokenizer.json", "generation_config.json")


def logits(model, ids):
    return model.compute_logits(PagedSequence(model).step(ids))


@pytest.fixture(scope="module")
def ids():
    return [BOS] + torch.randint(NUM_SPECIALS, VOCAB, (12,), generator=torch.Generator().manual_seed(2)).tolist()


def copy_with_tensors(src, dst, tensors: dict[str, torch.Tensor]):
    dst.mkdir(exist_ok=True)
    for name in SMALL_FILES:
        shutil.copy(src / name, dst / name)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_sharded_checkpoint_with_index_loads_identically(checkpoints, loaded_hub, ids, tmp_path):
    paths, hf = checkpoints
    hf.save_pretrained(str(tmp_path), max_shard_size="40KB")
    for name in SMALL_FILES[1:]:
        shutil.copy(paths["per_layer"] / name, tmp_path / name)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(set(checkpoint_files(tmp_path).values())) > 2
    model, _ = loaded_hub
    torch.testing.assert_close(logits(load_model(tmp_path), ids), logits(model, ids), rtol=0, atol=0)


def test_legacy_names_and_ignored_tensors(checkpoints, loaded_hub, ids, tmp_path):
    paths, _ = checkpoints
    renames = {"model.language_model.": "language_model.model.", "model.vision_tower.": "vision_tower.",
               "model.embed_vision.": "embed_vision."}
    tensors = {}
    for name, t in load_file(str(paths["per_layer"] / "model.safetensors")).items():
        for old, new in renames.items():
            if name.startswith(old):
                name = new + name[len(old):]
        tensors[name] = t
    tensors["lm_head.weight"] = torch.randn(VOCAB, 72)          # tied: the embedding wins
    tensors["model.embed_vision.embedding.weight"] = torch.randn(4, 4)  # vestigial in some checkpoints
    model, _ = loaded_hub
    ours = load_model(copy_with_tensors(paths["per_layer"], tmp_path / "legacy", tensors))
    torch.testing.assert_close(logits(ours, ids), logits(model, ids), rtol=0, atol=0)


@pytest.mark.parametrize("model_type,make_config,tied", [
    ("gemma4_text", tiny_config, False), ("gemma4_text", e_model_config, True),
    ("gemma4_unified_text", unified_config, False)], ids=["untied", "tied-ple", "unified-untied"])
def test_text_only_checkpoints_as_transformers_saves_them(checkpoints, ids, tmp_path, model_type, make_config, tied):
    """Gemma4ForCausalLM's `model.layers.*` names, tied or with its own `lm_head` (the text config's
    tie_word_embeddings: the wrapper's default True dropped an untied head before)."""
    from transformers import (
        Gemma4ForCausalLM,
        Gemma4TextConfig,
        Gemma4UnifiedForCausalLM,
        Gemma4UnifiedTextConfig,
    )

    config_cls, model_cls = {"gemma4_text": (Gemma4TextConfig, Gemma4ForCausalLM),
                             "gemma4_unified_text": (Gemma4UnifiedTextConfig, Gemma4UnifiedForCausalLM)}[model_type]
    cfg = config_cls(**make_config()["text_config"], tie_word_embeddings=tied)
    cfg._attn_implementation = "eager"
    hf = model_cls(cfg).eval()
    randomize_(hf, 4)
    hf.save_pretrained(str(tmp_path))
    for name in SMALL_FILES[1:]:
        shutil.copy(checkpoints[0]["per_layer"] / name, tmp_path / name)
    ours = load_model(tmp_path)
    assert (ours.decoder.lm_head is None) == tied and ours.spec.vision is None
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert_close(logits(ours, ids), ref)


@pytest.mark.parametrize("mutation,message", [
    ("drop", "missing 1 \\['decoder.layers.3.self_attn.q_norm.weight'\\]"),
    ("extra", "unexpected 1 \\['model.language_model.layers.2.self_attn.v_proj.weight'\\]"),
    ("shape", "decoder.norm.weight has shape \\(63,\\)"),
    ("int8_q_proj", "layers.0.self_attn.q_proj.weight is torch.int8, expected float32, bfloat16 or float16"),
    ("fp8_o_proj", "layers.0.self_attn.o_proj.weight is torch.float8_e4m3fn, expected float32"),
    ("int8_norm", "language_model.norm.weight is torch.int8, expected float32"),
])
def test_mismatched_checkpoints_fail_clearly(checkpoints, tmp_path, mutation, message):
    paths, _ = checkpoints
    tensors = load_file(str(paths["per_layer"] / "model.safetensors"))
    if mutation == "drop":
        del tensors["model.language_model.layers.3.self_attn.q_norm.weight"]
    elif mutation == "extra":  # layer 2 is a K=V full layer: it has no v_proj
        tensors["model.language_model.layers.2.self_attn.v_proj.weight"] = torch.zeros(32, 72)
    elif mutation == "shape":
        tensors["model.language_model.norm.weight"] = torch.ones(63)
    else:   # quantized: a cast loaded the q_proj ones silently as wrong values
        name, dtype = {"int8_q_proj": ("layers.0.self_attn.q_proj", torch.int8),
                       "fp8_o_proj": ("layers.0.self_attn.o_proj", torch.float8_e4m3fn),
                       "int8_norm": ("norm", torch.int8)}[mutation]
        name = f"model.language_model.{name}.weight"
        tensors[name] = (tensors[name] * 16).to(dtype)
    with pytest.raises(WeightLoadError, match=message):
        load_model(copy_with_tensors(paths["per_layer"], tmp_path / mutation, tensors))


Q_PROJ = "model.language_model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("layout,message", [
    ("stray_copy", "weight is in both model.safetensors and model_backup.safetensors"),
    ("unindexed_shards", "q_proj.weight is in both model-00001-of-00002.safetensors and model-00002-of-00002"),
    ("two_spellings", f"language_model.model.layers.0.self_attn.q_proj.weight and {Q_PROJ} are the same tensor"),
])
def test_a_tensor_given_twice_is_refused(checkpoints, tmp_path, layout, message):
    """Which copy is meant is unknown (transformers reads only model.safetensors; a sorted read let
    the last file's win): a zeroed second copy of q_proj loaded silently before."""
    paths, _ = checkpoints
    tensors = load_file(str(paths["per_layer"] / "model.safetensors"))
    second = {Q_PROJ: torch.zeros_like(tensors[Q_PROJ])}
    path = copy_with_tensors(paths["per_layer"], tmp_path / layout, tensors)
    if layout == "stray_copy":
        save_file(tensors | second, str(path / "model_backup.safetensors"))
    elif layout == "unindexed_shards":
        (path / "model.safetensors").unlink()
        names = sorted(tensors)
        first = {k: tensors[k] for k in names[:len(names) // 2]} | {Q_PROJ: tensors[Q_PROJ]}
        save_file(first, str(path / "model-00001-of-00002.safetensors"))
        save_file({k: tensors[k] for k in names[len(names) // 2:]} | second,
                  str(path / "model-00002-of-00002.safetensors"))
    else:
        save_file(tensors | {"language_model.model.layers.0.self_attn.q_proj.weight": second[Q_PROJ]},
                  str(path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=message):
        load_model(path)


@pytest.mark.parametrize("damage,message", [
    ("wrong_file", "s2.safetensors: holds no model.language_model.embed_tokens.weight, which model.safetensors"
                   ".index.json places there"),
    ("missing_file", "index.json places tensors in \\['s3.safetensors'\\], which .* does not hold"),
    ("no_weight_map", "index.json: no weight_map of tensor name -> file name"),
    ("truncated", "model.safetensors: not a readable safetensors file"),
])
def test_a_broken_index_or_file_fails_naming_it(checkpoints, tmp_path, damage, message):
    """Each ended in a bare SafetensorError, FileNotFoundError or KeyError before."""
    paths, _ = checkpoints
    tensors = load_file(str(paths["per_layer"] / "model.safetensors"))
    path = copy_with_tensors(paths["per_layer"], tmp_path / damage, tensors)
    if damage == "truncated":
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[:len(data) // 2])
    else:
        (path / "model.safetensors").unlink()
        embed = "model.language_model.embed_tokens.weight"   # in s1, placed by the index in s2 or s3
        names = sorted(set(tensors) - {embed})
        half = {"s1.safetensors": [embed, *names[:len(names) // 2]], "s2.safetensors": names[len(names) // 2:]}
        for fname, part in half.items():
            save_file({k: tensors[k] for k in part}, str(path / fname))
        weight_map = {k: fname for fname, part in half.items() for k in part}
        weight_map[embed] = {"wrong_file": "s2.safetensors", "missing_file": "s3.safetensors"}.get(damage, "s1.safetensors")
        index = {"weight_map": weight_map} if damage != "no_weight_map" else {}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightLoadError, match=message):
        load_model(path)
