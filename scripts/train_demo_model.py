"""Train the embedded demo model: a tiny Gemma 4 that captions synthetic moving-shape clips.

Reproducible (seeded, single-threaded data, deterministic CPU kernels) and small enough to train
on one CPU thread in about ten minutes (7.5 min training + 1 min check, measured on a shared
2-core machine). The model sees exactly the serving prompt layout, with frames
decoded from real encoded clips by our own decoder and preprocessing, so the served pipeline and
transformers' reference agree on every pixel and token.

    .venv/bin/python scripts/train_demo_model.py --out src/mmserve/demo_model
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Gemma4Config, Gemma4ForConditionalGeneration, GenerationConfig

from mmserve.multimodal import demo_task, synthetic
from mmserve.multimodal.demo_task import VisionParams

logger = logging.getLogger("train_demo_model")

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>",
                  "<|video|>", "<|audio>", "<audio|>", "<|audio|>"]
# A wider init than transformers' 0.02: at this width the small default leaves attention nearly
# uniform and the decoder sits for hundreds of steps on the caption prior before using the frames.
INIT_RANGE = 0.1
VISION = VisionParams(patch_size=4, pooling_kernel_size=2, max_soft_tokens=16)  # 32x32 frame -> 16 soft tokens

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] | trim }}"
    "{% elif part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'video' %}<|video|>{% endif %}"
    "{% endfor %}{% endif %}"
    "<turn|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE over the task's words; digits split one by one (timestamps are mm:ss)."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    words = [f"a {c} {s} moves {d}" for c in synthetic.COLOURS for s in synthetic.SHAPES for d in synthetic.DIRECTIONS]
    corpus = words + [" and ".join(words[i:i + 2]) for i in range(0, len(words), 2)]
    corpus += [demo_task.PROMPT, "user\nDescribe the image.", "model\n", "00:00 00:01 00:02"]
    trainer = trainers.BpeTrainer(vocab_size=384, min_frequency=2, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    return tok


def build_config(tok: Tokenizer) -> Gemma4Config:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    sliding, full = "sliding_attention", "full_attention"
    text = dict(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=24, layer_types=[sliding, sliding, full, sliding, full],
        rope_parameters={sliding: {"rope_type": "default", "rope_theta": 10000.0},
                         full: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}},
        use_bidirectional_attention="vision", final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=tok.get_vocab_size(), num_kv_shared_layers=0, max_position_embeddings=1024,
        pad_token_id=ids["<pad>"], eos_token_id=[ids["<eos>"], ids["<turn|>"]], bos_token_id=ids["<bos>"],
        initializer_range=INIT_RANGE,
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=VISION.patch_size,
                  pooling_kernel_size=VISION.pooling_kernel_size, position_embedding_size=64, max_position_embeddings=64,
                  standardize=True, initializer_range=INIT_RANGE)
    return Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None,
        boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"], image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"], audio_token_id=ids["<|audio|>"], boa_token_id=ids["<|audio>"],
        eoa_token_index=ids["<audio|>"], pad_token_id=ids["<pad>"], eos_token_id=[ids["<eos>"], ids["<turn|>"]],
        bos_token_id=ids["<bos>"],
    )


def make_example(tok: Tokenizer, seed: int) -> dict[str, torch.Tensor]:
    """One training example: prompt (either part order) + caption<turn|>, loss on the answer only."""
    data, caption = demo_task.clip_for(seed)
    ref = demo_task.reference_inputs(tok, data, VISION, video_first=seed % 2 == 0)
    answer = tok.encode(caption + "<turn|>", add_special_tokens=False).ids
    prompt = ref.input_ids[0]
    ids = torch.cat([prompt, torch.tensor(answer)])
    labels = torch.full_like(ids, -100)
    labels[len(prompt):] = ids[len(prompt):]
    return {"input_ids": ids, "labels": labels, "mm_token_type_ids": torch.cat([ref.mm_token_type_ids[0],
                                                                               torch.zeros(len(answer), dtype=torch.long)]),
            "pixel_values_videos": ref.pixel_values_videos, "video_position_ids": ref.video_position_ids}


def collate(examples: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad; pads come after every real token, so causal attention never lets them matter."""
    n = max(len(e["input_ids"]) for e in examples)

    def pad(key: str, value: int) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(e[key], (0, n - len(e[key])), value=value) for e in examples])

    return {"input_ids": pad("input_ids", pad_id), "labels": pad("labels", -100),
            "mm_token_type_ids": pad("mm_token_type_ids", 0),
            "pixel_values_videos": torch.cat([e["pixel_values_videos"] for e in examples]),
            "video_position_ids": torch.cat([e["video_position_ids"] for e in examples]),
            "num_frames_per_video": torch.tensor([len(e["pixel_values_videos"]) for e in examples])}


@torch.no_grad()
def calibrate_standardization(model: Gemma4ForConditionalGeneration, examples: list[dict[str, torch.Tensor]]) -> None:
    """Set the vision tower's std_bias/std_scale from real frames (data-dependent init).

    At random init the pooled features of every frame point the same way (cosine ~0.999), so the
    soft tokens barely differ and the decoder learns to ignore them; standardizing them per channel
    makes the content visible from the first step.
    """
    tower = model.model.vision_tower
    tower.std_bias.zero_()
    tower.std_scale.fill_(1.0)
    feats = tower(torch.cat([e["pixel_values_videos"] for e in examples]),
                  torch.cat([e["video_position_ids"] for e in examples])).last_hidden_state
    tower.std_bias.copy_(feats.mean(0))
    tower.std_scale.copy_(1.0 / (feats.std(0) + 1e-6))


def loss_of(model: Gemma4ForConditionalGeneration, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                                             ignore_index=-100)


@torch.no_grad()
def greedy_accuracy(model: Gemma4ForConditionalGeneration, tok: Tokenizer, seeds: list[int]) -> tuple[float, list]:
    """Exact-match rate of transformers' greedy captions on `seeds` (prompt order alternates)."""
    model.eval()
    eos = model.generation_config.eos_token_id
    misses = []
    for seed in seeds:
        data, truth = demo_task.clip_for(seed)
        ref = demo_task.reference_inputs(tok, data, VISION, video_first=seed % 2 == 0)
        out = model.generate(**ref.as_kwargs(), max_new_tokens=24, do_sample=False)
        new = [t for t in out[0, ref.input_ids.shape[1]:].tolist() if t not in eos]
        text = tok.decode(new, skip_special_tokens=True)
        if text != truth:
            misses.append((seed, truth, text))
    model.train()
    return 1 - len(misses) / len(seeds), misses


def save(model: Gemma4ForConditionalGeneration, tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "add_bos_token": False, "add_eos_token": False, "model_max_length": 1024,
        "extra_special_tokens": {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
                                 "video_token": "<|video|>", "sot_token": "<|turn>", "eot_token": "<turn|>"},
    }, indent=2) + "\n")
    vision = {"patch_size": VISION.patch_size, "pooling_kernel_size": VISION.pooling_kernel_size,
              "max_soft_tokens": VISION.max_soft_tokens, "do_resize": True, "resample": 3, "do_rescale": True,
              "rescale_factor": 1 / 255, "do_normalize": False, "do_convert_rgb": True}
    (out / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Gemma4ImageProcessor", **vision}, indent=2) + "\n")
    (out / "video_preprocessor_config.json").write_text(json.dumps(
        {"video_processor_type": "Gemma4VideoProcessor", **vision, "num_frames": demo_task.NUM_FRAMES,
         "do_sample_frames": True}, indent=2) + "\n")
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Gemma4Processor", "image_seq_length": VISION.max_soft_tokens}, indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("src/mmserve/demo_model"))
    p.add_argument("--train-clips", type=int, default=6000)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--target-loss", type=float, default=0.01,
                   help="stop early once the smoothed answer loss is below this")
    p.add_argument("--eval-clips", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="1 is fastest on a shared machine (no spin-waiting)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.use_deterministic_algorithms(True)

    tok = build_tokenizer()
    config = build_config(tok)
    config.text_config._attn_implementation = "sdpa"
    model = Gemma4ForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id, eos_token_id=config.eos_token_id,
        do_sample=False, max_new_tokens=24)
    logger.info("vocab %d, params %.2fM", tok.get_vocab_size(), sum(p.numel() for p in model.parameters()) / 1e6)

    t0 = time.time()
    data = [make_example(tok, s) for s in range(args.train_clips)]
    logger.info("built %d examples in %.0f s (prompt lengths %s)", len(data), time.time() - t0,
                sorted({int((e["labels"] == -100).sum()) for e in data}))

    calibrate_standardization(model, data[:128])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    gen = torch.Generator().manual_seed(args.seed)
    pad_id = config.pad_token_id
    model.train()
    t0 = time.time()
    smoothed = None
    for step in range(args.steps):
        idx = torch.randint(len(data), (args.batch,), generator=gen).tolist()
        loss = loss_of(model, collate([data[i] for i in idx], pad_id))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        smoothed = loss.item() if smoothed is None else 0.9 * smoothed + 0.1 * loss.item()
        if step % 10 == 0 or step == args.steps - 1:
            logger.info("step %d loss %.4f (smoothed %.4f) lr %.2e (%.0f s)", step, loss.item(), smoothed,
                        sched.get_last_lr()[0], time.time() - t0)
        if step >= 50 and smoothed < args.target_loss:
            logger.info("smoothed loss %.4f < %.4f at step %d: done", smoothed, args.target_loss, step)
            break

    save(model, tok, args.out)
    model = Gemma4ForConditionalGeneration.from_pretrained(args.out).eval()  # check what was saved
    seeds = [demo_task.HELDOUT_SEED_BASE + i for i in range(args.eval_clips)]
    acc, misses = greedy_accuracy(model, tok, seeds)
    logger.info("held-out exact-match accuracy (transformers greedy, %d clips): %.3f", len(seeds), acc)
    for m in misses[:10]:
        logger.info("miss seed %d: want %r got %r", *m)


if __name__ == "__main__":
    main()
