"""The front end's spec, read from config.json without transformers (model/config_json.py), against
the one transformers' config classes build (the engine's): field by field, for every checkpoint
config the tests and docs use, their flat and per-layer forms, the diff-only form `save_pretrained`
writes, and random variants with fields left out (so that the defaults decide). The default tables
are compared with transformers' classes, so a default that changes there fails here."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import random
import shutil
import sys
from pathlib import Path

import pytest
from gemma4_fixtures import assistant_config, e_model_config, moe_config, tiny_config, unified_config
from transformers import (
    Gemma4AssistantConfig,
    Gemma4AudioConfig,
    Gemma4Config,
    Gemma4TextConfig,
    Gemma4UnifiedAssistantConfig,
    Gemma4UnifiedAudioConfig,
    Gemma4UnifiedConfig,
    Gemma4UnifiedTextConfig,
    Gemma4UnifiedVisionConfig,
    Gemma4VisionConfig,
)
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

from mmserve.config import DEMO_ASSISTANT_DIR, DEMO_MODEL_DIR
from mmserve.model import assistant_spec, config_json
from mmserve.model.assistant_spec import load_assistant_spec, read_assistant_spec
from mmserve.model.spec import ModelSpec, load_spec, load_spec_without_transformers

FAMILY = Path(__file__).parents[1] / "fixtures" / "gemma4_family"
CLASSES = {"gemma4_text": Gemma4TextConfig, "gemma4_unified_text": Gemma4UnifiedTextConfig,
           "gemma4_vision": Gemma4VisionConfig, "gemma4_unified_vision": Gemma4UnifiedVisionConfig,
           "gemma4_audio": Gemma4AudioConfig, "gemma4_unified_audio": Gemma4UnifiedAudioConfig,
           "gemma4": Gemma4Config, "gemma4_unified": Gemma4UnifiedConfig,
           "gemma4_assistant": Gemma4AssistantConfig, "gemma4_unified_assistant": Gemma4UnifiedAssistantConfig}
SPEC_FIELDS = [f.name for f in dataclasses.fields(ModelSpec) if f.name != "hf_config"]


def _class_default(cls, name):
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    value = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("model_type", sorted(CLASSES))
def test_default_tables_are_transformers_defaults(model_type):
    table = {**config_json.TEXT_DEFAULTS, **config_json.VISION_DEFAULTS, **config_json.AUDIO_DEFAULTS,
             **{family: top for family, (*_, top) in config_json.FAMILIES.items()},
             **{name: top for name, (_, top) in config_json.ASSISTANTS.items()}}[model_type]
    theirs = {name: _class_default(CLASSES[model_type], name) for name in table}
    assert table == theirs


def test_feature_extractor_defaults_are_transformers_defaults():
    signature = inspect.signature(Gemma4AudioFeatureExtractor.__init__).parameters
    assert config_json.FEATURE_EXTRACTOR_DEFAULTS == {k: signature[k].default
                                                      for k in config_json.FEATURE_EXTRACTOR_DEFAULTS}


def _assert_same_spec(ours: ModelSpec, theirs: ModelSpec) -> None:
    differ = {name: (getattr(ours, name), getattr(theirs, name)) for name in SPEC_FIELDS
              if getattr(ours, name) != getattr(theirs, name)}
    assert not differ, differ


def _outcome(read, source):
    try:
        return read(source), None
    except Exception as exc:
        return None, (type(exc), str(exc))


def _saved(config: dict, unified: bool = False, *, diff: bool) -> dict:
    """config.json as `save_pretrained` writes it (`diff`: only what differs from the defaults)."""
    cls = Gemma4UnifiedConfig if unified else Gemma4Config
    return json.loads(cls(**copy.deepcopy(config)).to_json_string(use_diff=diff))


def _checkpoint_configs() -> dict[str, dict]:
    configs = {f"family/{p.stem}": json.loads(p.read_text()) for p in sorted(FAMILY.glob("*.json"))}
    configs["demo_model"] = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    for name, make, unified in (("tiny", tiny_config, False), ("e_model", e_model_config, False),
                                ("moe", moe_config, False), ("unified", unified_config, True)):
        configs[f"{name}/kwargs"] = dict(copy.deepcopy(make()), model_type="gemma4_unified" if unified else "gemma4")
        configs[f"{name}/saved"] = _saved(make(), unified, diff=False)
        configs[f"{name}/saved_diff"] = _saved(make(), unified, diff=True)
    text = dict(_saved(tiny_config(), diff=True)["text_config"], model_type="gemma4_text")
    configs["text_only"] = text
    configs["unified_text_only"] = dict(_saved(unified_config(), True, diff=True)["text_config"],
                                        model_type="gemma4_unified_text")
    return configs


CONFIGS = _checkpoint_configs()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_json_spec_is_the_transformers_spec(name, tmp_path):
    """Every checkpoint config the tests and docs serve: the same spec both ways, read without
    transformers (not through its fallback)."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[name]))
    if name == "demo_model":   # with its tokenizer, generation and processor files
        tmp_path = DEMO_MODEL_DIR
    if name == "e_model/saved":   # an audio tower's feature extractor settings beside it
        (tmp_path / "processor_config.json").write_text(json.dumps({
            "audio_ms_per_token": 40, "feature_extractor": {
                "feature_extractor_type": "Gemma4AudioFeatureExtractor", "sampling_rate": 16000,
                "frame_length_ms": 20.04, "hop_length_ms": 10.05, "feature_size": 128}}))   # 320.6, 160.8 samples: rounded
    ours = load_spec_without_transformers(tmp_path)
    assert isinstance(ours.hf_config, config_json.Gemma4JsonConfig), "read through transformers, not the JSON"
    _assert_same_spec(ours, load_spec(tmp_path))


@pytest.mark.parametrize("tied", [False, True, None], ids=["untied", "tied", "default"])
@pytest.mark.parametrize("name", ["text_only", "unified_text_only"])
def test_a_text_only_config_is_tied_as_its_text_config_says(name, tied, tmp_path):
    """As transformers' text config (which a text-only model ties by) says, both ways: the wrapper's
    own default (True) gave both True for an untied one before."""
    data = copy.deepcopy(CONFIGS[name])
    data.pop("tie_word_embeddings", None)
    if tied is not None:
        data["tie_word_embeddings"] = tied
    theirs = CLASSES[data["model_type"]](**{k: v for k, v in data.items() if k != "model_type"})
    assert theirs.tie_word_embeddings == (tied is not False)
    path = _write(tmp_path, data)
    ours = load_spec_without_transformers(path)
    assert isinstance(ours.hf_config, config_json.Gemma4JsonConfig), "read through transformers, not the JSON"
    assert ours.tie_word_embeddings == load_spec(path).tie_word_embeddings == theirs.tie_word_embeddings


def _variant(rng: random.Random, base: dict) -> dict:
    """`base` with random fields left out (their defaults then apply), layer types left to the
    default pattern, the flat or per-layer head dims, KV sharing and sub-configs varied."""
    data = copy.deepcopy(base)
    text = data.get("text_config", data)
    for key in list(text):
        if key not in ("model_type", "per_layer_config") and rng.random() < 0.25:
            text.pop(key)
    if rng.random() < 0.3:
        text.pop("layer_types", None)
        text.pop("per_layer_config", None)
        text["num_hidden_layers"] = rng.choice([6, 12])
    if rng.random() < 0.3:
        text["num_kv_shared_layers"] = rng.choice([0, 1, 2, 3])
    if rng.random() < 0.3:
        text.pop("per_layer_config", None)
        text["global_head_dim"] = rng.choice([16, 32, 64])
        text["num_global_key_value_heads"] = rng.choice([1, 2])
    for sub in ("vision_config", "audio_config"):
        if sub in data and isinstance(data[sub], dict):
            for key in list(data[sub]):
                if key != "model_type" and rng.random() < 0.25:
                    data[sub].pop(key)
            if rng.random() < 0.15:
                data[sub] = None
    for key in ("boi_token_id", "eoi_token_id", "audio_token_id", "tie_word_embeddings"):
        if key in data and rng.random() < 0.3:
            data.pop(key)
    return data


@pytest.mark.parametrize("seed", range(4))
def test_random_variants_agree_with_transformers(seed):
    """Fresh random variants of every config: the same spec both ways, or the same refusal (type
    and message) when transformers or the spec refuses one."""
    rng = random.Random(seed * 7919 + random.randrange(1 << 30))
    read_json = 0
    for name in sorted(CONFIGS):
        for _ in range(3):
            data = _variant(rng, CONFIGS[name])
            theirs, their_error = _outcome(load_spec, copy.deepcopy(data))
            ours, our_error = _outcome(load_spec_without_transformers, copy.deepcopy(data))
            assert our_error == their_error, (name, data)
            if theirs is not None:
                _assert_same_spec(ours, theirs)
                read_json += isinstance(ours.hf_config, config_json.Gemma4JsonConfig)
    assert read_json, "no variant was read without transformers: the comparison was vacuous"


@pytest.mark.parametrize(("where", "key", "value"), [
    ("text_config", "hidden_size", "64"),                  # a type transformers refuses
    ("text_config", "attention_bias", 1),
    ("text_config", "num_hidden_layers", 7),               # != len(layer_types)
    ("vision_config", "patch_size", 4.0),
    ("text_config", "per_layer_config", {"1": {"intermediate_size": 8}}),   # not resolved here
])
def test_what_json_cannot_resolve_fails_as_transformers_does(where, key, value, tmp_path):
    data = copy.deepcopy(CONFIGS["tiny/saved"])
    data[where][key] = value
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(config_json.NotResolvable):
        config_json.resolve(data)
    assert _outcome(load_spec_without_transformers, tmp_path)[1] == _outcome(load_spec, tmp_path)[1]


def _assistant_configs() -> dict[str, dict]:
    configs = {"demo_assistant": json.loads((DEMO_ASSISTANT_DIR / "config.json").read_text())}
    for name, kwargs in (("tiny", assistant_config(tiny_config())),
                         ("ordered", assistant_config(tiny_config(), ordered=True)),
                         ("one_shared_count", assistant_config(tiny_config(), num_kv_shared_layers=0))):
        for diff in (False, True):
            configs[f"{name}/{'saved_diff' if diff else 'saved'}"] = json.loads(
                Gemma4AssistantConfig(**copy.deepcopy(kwargs)).to_json_string(use_diff=diff))
    unified = assistant_config(unified_config())
    unified["text_config"] = dict(unified["text_config"], model_type="gemma4_unified_text")
    for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input", "enable_moe_block"):
        unified["text_config"].pop(key)
    configs["unified/saved_diff"] = json.loads(
        Gemma4UnifiedAssistantConfig(**unified).to_json_string(use_diff=True))
    return configs


ASSISTANTS = _assistant_configs()


def _write(tmp_path: Path, data: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(data))
    return tmp_path


@pytest.mark.parametrize("name", sorted(ASSISTANTS))
def test_the_json_assistant_spec_is_the_transformers_one(name, tmp_path, monkeypatch):
    """The demo drafter and the tests' (a count of shared layers left to the assistant config; a
    gemma4_unified one): the same spec from config.json alone."""
    path = _write(tmp_path, ASSISTANTS[name])
    theirs = load_assistant_spec(path)
    monkeypatch.setattr(assistant_spec, "_hf_config", _fell_back)
    assert read_assistant_spec(path) == theirs


def _fell_back(*args):
    """read_assistant_spec's fallback to transformers, taken on any exception of the config.json path
    (not only NotResolvable): fails the test, naming the exception it handles."""
    pytest.fail(f"read through transformers: {sys.exception()!r}")


def test_a_fallback_to_transformers_reads_config_json_once(tmp_path, monkeypatch):
    """A model and an assistant whose config.json needs transformers (a per-layer override of another
    field; a type it refuses): transformers parses the JSON already read, not the file again."""
    reads = []
    read_text = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: reads.append(self.name) or read_text(self, *a, **k))
    model = copy.deepcopy(CONFIGS["tiny/saved"])
    model["text_config"]["per_layer_config"] = {"1": {"intermediate_size": 8}}
    drafter = copy.deepcopy(ASSISTANTS["tiny/saved"])
    drafter["text_config"]["hidden_size"] = "64"
    for read, resolve, data in ((load_spec_without_transformers, config_json.resolve, model),
                                (read_assistant_spec, config_json.resolve_assistant, drafter)):
        with pytest.raises(config_json.NotResolvable):
            resolve(data)
        path = tmp_path / read.__name__
        path.mkdir()
        _write(path, data)
        reads.clear()
        _outcome(read, path)
        assert reads.count("config.json") == 1, (read.__name__, reads)


@pytest.mark.parametrize("seed", range(2))
def test_random_assistant_variants_agree_with_transformers(seed, tmp_path):
    """As for the models: the same spec both ways, or the same refusal."""
    rng = random.Random(seed * 104729 + random.randrange(1 << 30))
    read_json = 0
    for name in sorted(ASSISTANTS):
        for _ in range(4):
            data = _variant(rng, ASSISTANTS[name])
            for key in ("num_centroids", "centroid_intermediate_top_k", "backbone_hidden_size"):
                if key in data and rng.random() < 0.3:
                    data.pop(key)
            path = _write(tmp_path, data)
            ours, theirs = _outcome(read_assistant_spec, path), _outcome(load_assistant_spec, path)
            assert ours == theirs, (name, data)
            read_json += theirs[0] is not None and _outcome(config_json.resolve_assistant, data)[1] is None
    assert read_json, "no variant was read without transformers: the comparison was vacuous"


@pytest.mark.parametrize(("key", "value", "named"), [("hidden_size_per_layer_input", 8, "hidden_size_per_layer_input"),
                                                     ("enable_moe_block", True, "enable_moe_block"),
                                                     ("num_kv_shared_layers", 2, "must be shared")])
def test_what_an_assistant_may_not_be_is_refused_as_transformers_refuses_it(key, value, named, tmp_path):
    data = copy.deepcopy(ASSISTANTS["tiny/saved"])
    data["text_config"][key] = value
    path = _write(tmp_path, data)
    ours, theirs = _outcome(read_assistant_spec, path), _outcome(load_assistant_spec, path)
    assert ours == theirs and theirs[1] is not None and named in theirs[1][1], theirs


def test_a_refusal_in_a_field_the_front_end_skips_is_the_engines(tmp_path):
    """The front end reads only the spec's fields, so it starts on a config transformers refuses
    elsewhere (the vision tower's norm epsilon a string); the engine's load parses with transformers
    and refuses it, naming the field (its start then fails in one line: tests/reliability/
    test_rel_startup.py's failed-load test)."""
    from huggingface_hub.errors import StrictDataclassError

    from mmserve.model import load_model

    shutil.copytree(DEMO_MODEL_DIR, tmp_path / "model")
    data = json.loads((tmp_path / "model" / "config.json").read_text())
    data["vision_config"]["rms_norm_eps"] = "tiny"
    path = _write(tmp_path / "model", data)
    assert isinstance(load_spec_without_transformers(path).hf_config, config_json.Gemma4JsonConfig)
    with pytest.raises(StrictDataclassError, match="rms_norm_eps"):
        load_model(path)
