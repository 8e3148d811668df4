"""Train the embedded demo model's assistant: a tiny `gemma4_assistant` drafter, distilled from it.

The frozen demo model (src/mmserve/demo_model) captions demo-task clips greedily; the drafter
learns to predict its next tokens from exactly what serving gives it (spec_decode/speculator.py,
transformers' Gemma4AssistantCandidateGenerator): the target's final hidden state of the row that
produced the last token, that token's target embedding, and cross-attention over the target's
K/V of its last sliding and last full layer (keys before the token), at the token's position,
held constant for K draft steps, each step fed the previous step's post-projected state and its
token. Training unrolls those K steps (teacher-forced on the target's tokens: a draft that is wrong
ends the accepted prefix anyway) with transformers' trainable Gemma4AssistantForCausalLM, so the
checkpoint is the HF format our loader reads. Labels are the target's own greedy tokens, over 32
tokens past the prompt (EOS ignored, as bench/speculative.py decodes), so the caption and what the
model says after it are both drafted.

Seeded, one CPU thread, deterministic kernels; ~4 minutes on a shared 2-core machine. Two runs agree
to the float rounding of CPU kernels only (their losses part after ~100 steps), not bit for bit; the
result does not move: held-out acceptance per draft position 0.97 / 0.97 / 0.97 on the first round
of a caption, >= 0.94 over the whole caption, >= 0.99 over all 32 tokens, in both runs.

    .venv/bin/python scripts/train_demo_assistant.py --out src/mmserve/demo_assistant
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForConditionalGeneration

from mmserve.config import DEMO_MODEL_DIR
from mmserve.multimodal import demo_task
from mmserve.multimodal.demo_task import VisionParams

logger = logging.getLogger("train_demo_assistant")

SLIDING, FULL = "sliding_attention", "full_attention"
GENERATED = 32   # target tokens per clip the drafter learns to predict (bench/speculative.py's max_tokens)


@dataclass
class TargetStates:
    """The frozen target's view of a set of clips, padded to one length T: everything a drafter needs."""

    tokens: torch.Tensor      # [C, T] prompt + greedy continuation
    hidden: torch.Tensor      # [C, T, backbone] final-normed hidden states
    kv: dict[str, tuple[torch.Tensor, torch.Tensor]]   # per layer type: K, V [C, Hkv, T, D]
    first: torch.Tensor       # [C] index of the first generated token (the prompt's length)
    eos_at: torch.Tensor      # [C] index of the first end-of-turn token generated (T if none)


def vision_params(model_dir: Path) -> VisionParams:
    v = json.loads((model_dir / "video_preprocessor_config.json").read_text())
    return VisionParams(v["patch_size"], v["pooling_kernel_size"], v["max_soft_tokens"])


@torch.no_grad()
def target_states(target: Gemma4ForConditionalGeneration, tok: Tokenizer, vision: VisionParams, seeds: list[int],
                  num_drafts: int) -> TargetStates:
    """Greedy continuations (EOS ignored) of each clip's prompt, then one forward over prompt + continuation
    for the hidden states and the storing layers' K/V (the same values incremental decoding computes)."""
    new = GENERATED + num_drafts
    eos = set(target.generation_config.eos_token_id)
    by_length: dict[int, list] = {}
    for seed in seeds:   # prompt order alternates, as the demo model was trained
        data, _ = demo_task.clip_for(seed)
        ref = demo_task.reference_inputs(tok, data, vision, video_first=seed % 2 == 0)
        by_length.setdefault(ref.input_ids.shape[1], []).append(ref)
    tokens, hidden, first, eos_at = [], [], [], []
    kv = {SLIDING: ([], []), FULL: ([], [])}
    for length, refs in sorted(by_length.items()):
        for i in range(0, len(refs), 64):   # same-length prompts: a batch with no padding
            chunk = refs[i:i + 64]
            kwargs = {k: torch.cat([getattr(r, k) for r in chunk]) for k in vars(chunk[0])}
            out = target.generate(**kwargs, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  eos_token_id=None, pad_token_id=target.config.pad_token_id)
            kwargs["mm_token_type_ids"] = F.pad(kwargs["mm_token_type_ids"], (0, new))
            states = target.model(**{**kwargs, "input_ids": out}, use_cache=False, return_shared_kv_states=True)
            tokens.append(out)
            hidden.append(states.last_hidden_state)
            for t in kv:
                kv[t][0].append(states.shared_kv_states[t][0])
                kv[t][1].append(states.shared_kv_states[t][1])
            first += [length] * len(chunk)
            for row in out[:, length:].tolist():
                eos_at.append(length + next((j for j, x in enumerate(row) if x in eos), len(row)))
    width = max(x.shape[1] for x in tokens)

    def pad(x: torch.Tensor, dim: int) -> torch.Tensor:
        pads = [0, 0] * (x.dim() - 1 - dim) + [0, width - x.shape[dim]]
        return F.pad(x, pads)

    return TargetStates(torch.cat([pad(x, 1) for x in tokens]), torch.cat([pad(x, 1) for x in hidden]),
                        {t: (torch.cat([pad(x, 2) for x in k]), torch.cat([pad(x, 2) for x in v]))
                         for t, (k, v) in kv.items()},
                        torch.tensor(first), torch.tensor(eos_at))


def draft_inputs(states: TargetStates, clips: torch.Tensor, positions: torch.Tensor, embed: torch.nn.Module):
    """For drafting rounds from token `positions[b]` of clip `clips[b]`: the step-1 input embeddings,
    position ids, the shared K/V left-padded so the keys before the token end each row, and its mask."""
    n = int(positions.max())
    index = positions[:, None] - n + torch.arange(n)                  # [B, n]: key index, negative = padding
    mask = (index >= 0).long()
    index = index.clamp(min=0)
    shared = {}
    for t, (k, v) in states.kv.items():
        rows = k[clips]                                                 # [B, H, T, D]
        gather = index[:, None, :, None].expand(-1, rows.shape[1], -1, rows.shape[3])
        shared[t] = (rows.gather(2, gather), v[clips].gather(2, gather))
    token = states.tokens[clips, positions]
    hidden = states.hidden[clips, positions - 1]
    return embed(token)[:, None], hidden[:, None], positions[:, None], mask, shared


def unroll(assistant, embed, states: TargetStates, clips, positions, num_drafts: int, *, teacher_forced: bool):
    """K draft steps from each (clip, position): logits [B, K, V]. Teacher-forced steps feed the target's
    token to the next step; free-running ones the draft's own argmax (as serving does)."""
    token_embed, hidden, position_ids, mask, shared = draft_inputs(states, clips, positions, embed)
    logits = []
    for k in range(num_drafts):
        out = assistant(inputs_embeds=torch.cat([token_embed, hidden], dim=-1), attention_mask=mask,
                        position_ids=position_ids, shared_kv_states=shared, use_cache=False)
        logits.append(out.logits[:, 0])
        nxt = states.tokens[clips, positions + k + 1] if teacher_forced else out.logits[:, 0].argmax(-1)
        token_embed, hidden = embed(nxt)[:, None], out.last_hidden_state
    return torch.stack(logits, dim=1)


def labels_of(states: TargetStates, clips, positions, num_drafts: int) -> torch.Tensor:
    """The target's greedy tokens the K drafts should equal: those after the token drafted from."""
    return states.tokens[clips[:, None], positions[:, None] + 1 + torch.arange(num_drafts)]


def all_rounds(states: TargetStates) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (clip, position) a drafting round may start from: each generated token within GENERATED."""
    clips = torch.arange(len(states.first)).repeat_interleave(GENERATED)
    positions = states.first.repeat_interleave(GENERATED) + torch.arange(GENERATED).repeat(len(states.first))
    return clips, positions


def round_weights(states: TargetStates, clips: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """How often training draws each round. Serving's first round of a request drafts from the caption's
    first token ("a"), where the target's hidden state says little yet and the colour must be read from
    the video's K/V: the one hard round, so it is drawn most; the rest of the caption next; what follows
    the caption (the target repeating itself) is easy and least drawn."""
    offset = positions - states.first[clips]
    in_caption = positions < states.eos_at[clips]
    return 1.0 + 4.0 * in_caption.float() + 12.0 * (offset == 0).float()


@torch.no_grad()
def acceptance(assistant, embed, states: TargetStates, num_drafts: int) -> dict[str, list[float]]:
    """Free-running drafts from every position: the rate each draft position is accepted (its whole
    prefix equal to the target's tokens), over the caption (rounds before the target's end of turn)
    and over all GENERATED tokens."""
    assistant.eval()
    clips, positions = all_rounds(states)
    hits = []
    for i in range(0, len(clips), 512):
        c, p = clips[i:i + 512], positions[i:i + 512]
        drafts = unroll(assistant, embed, states, c, p, num_drafts, teacher_forced=False).argmax(-1)
        hits.append((drafts == labels_of(states, c, p, num_drafts)).long().cumprod(dim=1).bool())
    hits = torch.cat(hits).float()
    caption = positions < states.eos_at[clips]
    assistant.train()
    return {"first round": hits[positions == states.first[clips]].mean(0).tolist(),
            "caption": hits[caption].mean(0).tolist(), "all": hits.mean(0).tolist()}


def build_config(target: Gemma4ForConditionalGeneration, layer_types: list[str], hidden: int,
                 intermediate: int) -> Gemma4AssistantConfig:
    """The target's text config, narrowed to the drafter: its layers KV-sharing consumers of the target's
    storing layers (head dims and KV heads theirs), no per-layer embeddings, no experts."""
    text = target.config.get_text_config().to_dict()
    full = text.get("per_layer_config", {}).get(str(text["layer_types"].index(FULL)), {})
    draft = {k: v for k, v in text.items() if k not in ("per_layer_config", "layer_types", "architectures")}
    draft.update(global_head_dim=full.get("head_dim", text["head_dim"]),
                 num_global_key_value_heads=full.get("num_key_value_heads", text["num_key_value_heads"]),
                 initializer_range=0.02)
    draft.update(num_hidden_layers=len(layer_types), layer_types=layer_types, num_kv_shared_layers=len(layer_types),
                 hidden_size=hidden, intermediate_size=intermediate, hidden_size_per_layer_input=0,
                 vocab_size_per_layer_input=0, enable_moe_block=False, use_double_wide_mlp=False)
    return Gemma4AssistantConfig(text_config=draft, backbone_hidden_size=text["hidden_size"],
                                 use_ordered_embeddings=False, tie_word_embeddings=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=DEMO_MODEL_DIR)
    p.add_argument("--out", type=Path, default=Path("src/mmserve/demo_assistant"))
    p.add_argument("--train-clips", type=int, default=1536)
    p.add_argument("--eval-clips", type=int, default=64)
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--batch", type=int, default=128, help="drafting rounds per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--num-drafts", type=int, default=3, help="K: the draft steps unrolled (serving's default)")
    p.add_argument("--layers", default=FULL, help="comma-separated layer types of the drafter")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="1 is fastest on a shared machine (no spin-waiting)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.use_deterministic_algorithms(True)

    target = Gemma4ForConditionalGeneration.from_pretrained(args.target, dtype=torch.float32).eval()
    target.requires_grad_(False)
    embed = target.get_input_embeddings()   # the drafter's token input is the TARGET's embedding
    tok = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    vision = vision_params(args.target)
    t0 = time.time()
    train = target_states(target, tok, vision, list(range(args.train_clips)), args.num_drafts)
    held_out = target_states(target, tok, vision, [demo_task.HELDOUT_SEED_BASE + i for i in range(args.eval_clips)],
                             args.num_drafts)
    logger.info("target states for %d + %d clips in %.0f s (prompt lengths %s)", args.train_clips, args.eval_clips,
                time.time() - t0, sorted(set(train.first.tolist())))

    config = build_config(target, args.layers.split(","), args.hidden, args.intermediate)
    config.get_text_config()._attn_implementation = "sdpa"
    assistant = Gemma4AssistantForCausalLM(config).train()
    logger.info("assistant: layers %s, params %.3fM", args.layers,
                sum(x.numel() for x in assistant.parameters()) / 1e6)
    opt = torch.optim.AdamW(assistant.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    gen = torch.Generator().manual_seed(args.seed)
    clips, positions = all_rounds(train)
    weights = round_weights(train, clips, positions)
    t0 = time.time()
    for step in range(args.steps):
        pick = torch.multinomial(weights, args.batch, replacement=True, generator=gen)
        c, q = clips[pick], positions[pick]
        logits = unroll(assistant, embed, train, c, q, args.num_drafts, teacher_forced=True)
        loss = F.cross_entropy(logits.flatten(0, 1), labels_of(train, c, q, args.num_drafts).flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(assistant.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == args.steps - 1:
            logger.info("step %d loss %.4f lr %.2e (%.0f s)", step, loss.item(), sched.get_last_lr()[0], time.time() - t0)
        if step % 400 == 399:
            logger.info("held-out acceptance per draft position: %s",
                        {k: [round(x, 3) for x in v] for k, v in acceptance(assistant, embed, held_out,
                                                                             args.num_drafts).items()})

    args.out.mkdir(parents=True, exist_ok=True)
    assistant.generation_config.num_assistant_tokens = args.num_drafts   # transformers' assisted generation
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.save_pretrained(args.out)
    saved = Gemma4AssistantForCausalLM.from_pretrained(args.out, dtype=torch.float32)   # check what was saved
    rates = acceptance(saved, embed, held_out, args.num_drafts)
    logger.info("saved %s; held-out acceptance per draft position (%d clips): %s", args.out, args.eval_clips,
                {k: [round(x, 3) for x in v] for k, v in rates.items()})


if __name__ == "__main__":
    main()
