"""Shared fixtures for model tests (and anyone who needs a tiny Gemma 4 checkpoint).

`make_checkpoint(dir, ...)` builds a tiny random `Gemma4ForConditionalGeneration` in transformers with
EVERY parameter and buffer randomised (norm weights, layer scalars, vision std_bias/std_scale), so an
identity initialisation hides nothing; saves it with `save_pretrained` (optionally rewriting the
config to the hub's flat `global_head_dim` form) beside a `tokenizers`-made tokenizer.json and a
generation_config.json whose eos list includes `<turn|>`.
`PagedSequence` drives our model for one request over a paged cache with shuffled blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from mmserve.attention import PoolConfig, create_builder
from mmserve.attention.backend import CommonAttentionMetadata, kv_cache_shape
from mmserve.core.sched.output import BlockUpdate
from mmserve.worker.block_table import BlockTables

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>",
            "<|video|>", "<|audio>", "<audio|>", "<|audio|>"]
PAD, EOS, BOS = 0, 1, 2
TURN_OPEN, TURN_CLOSE, BOI, EOI, IMAGE, VIDEO, BOA, EOA, AUDIO = range(4, 13)
NUM_SPECIALS = 16          # byte tokens start here
VOCAB = NUM_SPECIALS + 256 + 48   # bytes + a few merges


def tiny_config(*, window: int = 6, vocab: int = VOCAB, **text_overrides) -> dict:
    """Gemma4Config kwargs: dense 31B-like (K=V full layers, head dims 16/32, proportional RoPE, bidi vision).

    hidden 72 is not a square, so the embedding scale sqrt(72) rounds differently per dtype."""
    text = dict(vocab_size=vocab, hidden_size=72, intermediate_size=96, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=window,
                layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                    "rope_theta": 1000000.0}},
                use_bidirectional_attention="vision", final_logit_softcapping=30.0,
                hidden_size_per_layer_input=0, num_kv_shared_layers=0, max_position_embeddings=1024,
                pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    text.update(text_overrides)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                  position_embedding_size=64, standardize=True)
    return dict(text_config=text, vision_config=vision, audio_config=None, boi_token_id=BOI, eoi_token_id=EOI,
                image_token_id=IMAGE, video_token_id=VIDEO, audio_token_id=AUDIO, boa_token_id=BOA,
                eoa_token_index=EOA)


def audio_config() -> dict:
    """A tiny Gemma4AudioConfig: the real 128 mel bins (the first conv's channels must match them),
    2 conformer blocks of width 16, local attention over chunks of 4 with 4 keys of left context,
    clipped linears (their bounds are checkpoint buffers, as in E2B's)."""
    return dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[128, 4],
                conv_kernel_size=3, attention_chunk_size=4, attention_context_left=5, attention_context_right=0,
                output_proj_dims=24, use_clipped_linears=True)


def e_model_config(*, audio: bool = True, **text_overrides) -> dict:
    """E2B-like: per-layer embeddings, the last 3 of 6 layers share KV (double-wide MLPs there),
    separate V projections, causal frames (E-models ship use_bidirectional_attention=None), and an
    audio tower (`audio=False`: none)."""
    cfg = tiny_config(window=5, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                      num_kv_shared_layers=3, use_double_wide_mlp=True, attention_k_eq_v=False,
                      use_bidirectional_attention=None, **text_overrides)
    cfg["audio_config"] = audio_config() if audio else None
    return cfg


def moe_config(**text_overrides) -> dict:
    """26B-A4B-like: 6 experts, top-3, beside the dense MLP on every layer; K=V full layers, bidi frames."""
    return tiny_config(window=5, enable_moe_block=True, num_experts=6, top_k_experts=3, moe_intermediate_size=20,
                       **text_overrides)


def unified_config(**text_overrides) -> dict:
    """12B-like gemma4_unified: the dense text stack and the encoder-free vision embedder (8-px model
    patches: patch 4 merged 2 x 2, the same soft-token counts as the tiny tower)."""
    cfg = tiny_config(**text_overrides)
    for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        cfg["text_config"].pop(key, None)
    cfg["vision_config"] = dict(patch_size=4, pooling_kernel_size=2, mm_embed_dim=24, mm_posemb_size=16,
                                output_proj_dims=24)
    return cfg


def make_tokenizer() -> Tokenizer:
    """A byte-level BPE whose specials sit at fixed small ids (specials first, then 256 bytes)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"<reserved{i}>": i for i in range(len(SPECIALS), NUM_SPECIALS)})
    vocab.update({ch: NUM_SPECIALS + i for i, ch in enumerate(sorted(alphabet))})
    merges = []
    for a, b in [("t", "h"), ("th", "e"), ("Ġ", "a"), ("i", "n"), ("Ġ", "the"), ("e", "r"), ("o", "n"),
                 ("Ġ", "c"), ("a", "t"), ("Ġc", "at"), ("0", "0"), ("00", ":"), ("Ã", "©")]:
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter and floating buffer random (norms around 1, scalars around 0.9)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point() or any(k in name for k in ("inv_freq", "embed_scale", "inv_timescales",
                                                                       "softcap")):
                continue   # derived buffers, not saved: the checkpoint must load into what was saved
            noise = torch.randn(t.shape, generator=gen)
            if name.endswith(("input_min", "output_min", "input_max", "output_max")):   # clip bounds, wide
                t.copy_((2.0 + noise.abs()) * (-1 if name.endswith("min") else 1))
                continue
            if name.endswith(("norm.weight", "ln1.weight", "ln2.weight")) or "layer_scalar" in name \
                    or "std_scale" in name:
                t.copy_(1.0 + 0.2 * noise if "layer_scalar" not in name else 0.9 + 0.05 * noise)
            elif "std_bias" in name:
                t.copy_(0.3 * noise)
            else:
                t.copy_(0.08 * noise)


def make_checkpoint(root: Path, *, form: str = "per_layer", seed: int = 0, config: dict | None = None,
                    attn: str = "eager", unified: bool = False):
    """Save a tiny random checkpoint to `root` (`unified`: a gemma4_unified one); returns the
    transformers model (eval, fp32) for reference."""
    from transformers import (
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4UnifiedConfig,
        Gemma4UnifiedForConditionalGeneration,
    )

    config_cls, model_cls = ((Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration) if unified
                             else (Gemma4Config, Gemma4ForConditionalGeneration))
    cfg = config_cls(**(config or tiny_config()))
    cfg._attn_implementation = attn
    cfg.get_text_config()._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    randomize_(model, seed)
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(root))
    if form == "flat":
        to_flat_form(root / "config.json")
    make_tokenizer().save(str(root / "tokenizer.json"))
    (root / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS, "eos_token_id": [EOS, TURN_CLOSE],
                                                             "pad_token_id": PAD}))
    return model


def to_flat_form(config_json: Path) -> None:
    """Rewrite a 5.24-saved config (per_layer_config) into the hub's global_head_dim form (which also
    carries vision keys transformers 5.24 does not define, such as default_output_length)."""
    raw = json.loads(config_json.read_text())
    raw["vision_config"]["default_output_length"] = 280
    text = raw["text_config"]
    per_layer = text.pop("per_layer_config")
    first = next(iter(per_layer.values()))
    text["global_head_dim"] = first["head_dim"]
    if "num_key_value_heads" in first:
        text["num_global_key_value_heads"] = first["num_key_value_heads"]
    config_json.write_text(json.dumps(raw, indent=2))


def patchify(image: torch.Tensor, patch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, H, W) in [0, 1] -> patches [N, p*p*3] (row-major, (py, px, C) order) and positions [N, 2] as (x, y)."""
    c, h, w = image.shape
    x = image.reshape(c, h // patch, patch, w // patch, patch).permute(1, 3, 2, 4, 0).reshape(-1, patch * patch * c)
    gx, gy = torch.meshgrid(torch.arange(w // patch), torch.arange(h // patch), indexing="xy")
    return x, torch.stack([gx, gy], -1).reshape(-1, 2)


def runner_tables(pools, tables: dict[str, list[int]], width: int, into: BlockTables | None = None) -> BlockTables:
    """The runner's block tables (`into`, else new ones `width` wide) after a step that schedules each
    request of `tables` (request id -> its blocks, the same in every pool) with its blocks as new."""
    out = into if into is not None else BlockTables(pools, width)
    out.apply([_Scheduled(_Id(rid), {t: BlockUpdate(0, list(blocks), 0) for t in out.rows})
               for rid, blocks in tables.items()])
    return out


@dataclass
class _Id:
    request_id: str


@dataclass
class _Scheduled:   # what BlockTables.apply reads of a ScheduledRequest
    request: _Id
    block_updates: dict


@dataclass
class PagedSequence:
    """One request over per-layer paged caches with shuffled physical blocks (block 0 = null block).

    `step(ids, ranges)` schedules the next tokens and returns our model's final hidden states.
    """

    model: object
    block_size: int = 4
    num_blocks: int = 64
    seed: int = 0
    num_computed: int = 0
    ranges: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        spec, dev = self.model.spec, self.model.device
        gen = torch.Generator().manual_seed(self.seed)
        self.kv_caches = [torch.randn(kv_cache_shape(self.num_blocks, self.block_size, spec.attention_specs[t]),
                                      generator=gen).to(device=dev, dtype=self.model.dtype) for t in spec.layer_types]
        self.blocks = (torch.randperm(self.num_blocks - 1, generator=gen) + 1).to(torch.int32)

    def metadata(self, num_tokens: int, start: int | None = None) -> CommonAttentionMetadata:
        """The next `num_tokens` (or, with `start`, positions start.. of the same step's context)."""
        dev = self.model.device
        start = self.num_computed if start is None else start
        seq_len = start + num_tokens
        positions = torch.arange(start, seq_len)
        slots = self.blocks[positions // self.block_size].long() * self.block_size + positions % self.block_size
        rows = [next(((s, e) for s, e in self.ranges if s <= p <= e), (-1, -1)) for p in positions.tolist()]
        table = torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)
        table = table if bool((table[:, 0] >= 0).any()) else None
        qsl = torch.tensor([0, num_tokens], dtype=torch.int32)
        seq_lens = torch.tensor([seq_len], dtype=torch.int32)
        return CommonAttentionMetadata(
            num_actual_tokens=num_tokens, num_reqs=1, max_query_len=num_tokens, max_seq_len=seq_len,
            query_start_loc=qsl.to(dev), seq_lens=seq_lens.to(dev), positions=positions.to(dev),
            block_table=self.blocks[None].to(dev), slot_mapping=slots.to(dev), block_size=self.block_size,
            query_ranges=None if table is None else table.to(dev), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
            positions_cpu=positions, block_table_cpu=self.blocks[None], query_ranges_cpu=table)

    def backend_metadata(self, common: CommonAttentionMetadata) -> dict:
        """Each layer type's backend metadata, from that backend's builder (as the runner does)."""
        spec, model = self.model.spec, self.model
        pools = {t: PoolConfig(a, num_blocks=self.num_blocks, block_size=self.block_size,
                               max_num_tokens=max(common.num_actual_tokens, 64), max_num_reqs=1,
                               max_blocks_per_req=len(self.blocks), device=model.device, dtype=model.dtype)
                 for t, a in spec.attention_specs.items()}
        return {t: create_builder(model.attention_backends[t], pool).build(common) for t, pool in pools.items()}

    def step(self, ids: list[int], mm_embeds: torch.Tensor | None = None, last_row_only: bool = False) -> torch.Tensor:
        """Run `ids` (the next tokens); `mm_embeds` rows go to this chunk's placeholder tokens in order.
        `last_row_only`: return the last row alone, KV-sharing layers running on it alone (SampledRows)."""
        from mmserve.model.decoder import SampledRows

        spec = self.model.spec
        sampled = None
        if last_row_only:
            last = self.metadata(1, start=self.num_computed + len(ids) - 1)
            sampled = SampledRows(torch.tensor([len(ids) - 1], device=self.model.device), self.backend_metadata(last))
        md = self.metadata(len(ids))
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.model.device)
        index = None
        if mm_embeds is not None:
            index = torch.nonzero((input_ids == spec.image_token_id) | (input_ids == spec.video_token_id)).flatten()
        hidden = self.model.forward(input_ids, md.positions, self.backend_metadata(md), self.kv_caches,
                                    mm_embeds, index, sampled)
        self.num_computed += len(ids)
        return hidden


def assistant_config(target: dict, *, ordered: bool = False, hidden: int = 40, **text_overrides) -> dict:
    """Gemma4AssistantConfig kwargs for a drafter of `target` (a tiny_config dict): 3 KV-sharing layers
    (sliding, sliding, full) with the target's head dims and KV heads, its own width, heads, window and
    RoPE; `ordered`: the centroid head (8 centroids, top 3)."""
    t = target["text_config"]
    text = dict(t, model_type="gemma4_text", hidden_size=hidden, intermediate_size=56, num_attention_heads=4,
                num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                num_kv_shared_layers=3, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                enable_moe_block=False, use_double_wide_mlp=False, sliding_window=t["sliding_window"] - 1,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
                                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                    "rope_theta": 100000.0}})
    text.update(text_overrides)
    return dict(text_config=text, backbone_hidden_size=t["hidden_size"], use_ordered_embeddings=ordered,
                num_centroids=8, centroid_intermediate_top_k=3)


def make_assistant(root: Path, target: dict, *, seed: int = 0, ordered: bool = False, copy_from=None, **overrides):
    """Save a tiny random Gemma4AssistantForCausalLM for `target` to `root` (a random `token_ordering`
    permutation with `ordered`); returns the transformers model (eval, fp32, eager attention).

    `copy_from` (the target's transformers model): a drafter that mostly proposes the token it is
    given, as a trained one often would where the target repeats itself, so a test sees drafts
    accepted as well as rejected: the target's width, its embedding table as the head, the token
    embedding passed through `pre_projection`, and the (still random) layers and hidden-state input
    scaled down so they only sometimes change the argmax."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    if copy_from is not None:
        overrides.setdefault("hidden", target["text_config"]["hidden_size"])
    cfg = Gemma4AssistantConfig(**assistant_config(target, ordered=ordered, **overrides))
    cfg._attn_implementation = "eager"
    cfg.get_text_config()._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(cfg).eval()
    randomize_(model, seed)
    if copy_from is not None:
        with torch.no_grad():
            width = cfg.backbone_hidden_size
            model.model.embed_tokens.weight.copy_(copy_from.get_input_embeddings().weight)
            model.pre_projection.weight[:, :width].copy_(torch.eye(width))
            model.pre_projection.weight[:, width:].mul_(0.05)
            for name, param in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    param.mul_(0.1)
    if ordered:
        order = torch.randperm(cfg.get_text_config().vocab_size, generator=torch.Generator().manual_seed(seed))
        model.masked_embedding.token_ordering.copy_(order)
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(root))
    return model
