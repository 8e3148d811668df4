"""Speculative decoding, offline (mmserve.LLM, no gRPC): greedy decode speed with and without the
assistant on identical requests, acceptance per draft position, and a check that the tokens match.

There is no trained assistant for the demo model yet (issue 25's step 5), so this builds an
UNTRAINED one: the target's width, its embedding table as the head, the token embedding passed
straight through, small random layers. It mostly drafts the token it is given, so it is accepted
only where the target repeats itself: these numbers are speculation's cost with a poor drafter
(drafting and verifying K + 1 rows per request per step), not its gain with a trained one.

    python bench/speculative.py            # demo model, N = 1, 4, 16, K = 3, 48 tokens (a minute on 2 cores)
    python bench/speculative.py --smoke    # seconds: N = 1, 2, 8 tokens; JSON to a temp file

Prints a table and writes JSON (default bench/results/speculative.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from mmserve.config import DEMO_MODEL_DIR
from mmserve.engine.llm import LLM
from mmserve.engine.sampling_params import SamplingParams
from mmserve.model.tokenizer import load_tokenizer

PROMPT = "Describe what happens in the video, then say it again in other words."


def untrained_assistant(target: Path, out: Path, seed: int = 0) -> Path:
    """A gemma4_assistant for `target` (one sliding and one full KV-sharing layer), as described above."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForConditionalGeneration

    text = json.loads((target / "config.json").read_text())["text_config"]
    types = text["layer_types"]
    per_layer = text.get("per_layer_config", {})
    full = per_layer.get(str(types.index("full_attention")), {})
    draft = dict(text, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                 per_layer_config=None, num_kv_shared_layers=2, hidden_size_per_layer_input=0,
                 vocab_size_per_layer_input=0, enable_moe_block=False, use_double_wide_mlp=False,
                 global_head_dim=full.get("head_dim", text["head_dim"]),
                 num_global_key_value_heads=full.get("num_key_value_heads", text["num_key_value_heads"]))
    draft.pop("per_layer_config")
    cfg = Gemma4AssistantConfig(text_config=draft, backbone_hidden_size=text["hidden_size"])
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(cfg).eval()
    embed = Gemma4ForConditionalGeneration.from_pretrained(str(target)).get_input_embeddings().weight
    width = text["hidden_size"]
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embed)
        model.pre_projection.weight.zero_()
        model.pre_projection.weight[:, :width].copy_(torch.eye(width))
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(0.1)
    model.save_pretrained(str(out))
    return out


def run(model: Path, assistant: Path | None, n: int, max_tokens: int, k: int, repeats: int) -> dict:
    """Best of `repeats` runs of n identical requests (one torch thread: steadier on a shared machine)."""
    options = dict(device="cpu", dtype="float32", max_num_seqs=max(n, 1), engine_threads=1)
    if assistant is not None:
        options.update(speculative_model=str(assistant), num_speculative_tokens=k)
    llm = LLM(str(model), **options)
    prompt = load_tokenizer(model).encode(PROMPT)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], sampling)   # warm-up
    seconds = []
    for _ in range(repeats):
        first = llm.core.step_index
        start = time.perf_counter()
        done = llm.generate([prompt] * n, sampling)
        seconds.append(time.perf_counter() - start)
    spec = llm.core.speculator
    return dict(n=n, speculative=assistant is not None, seconds=min(seconds), tok_s=n * max_tokens / min(seconds),
                steps=llm.core.step_index - first, tokens=[c.token_ids for c in done],
                acceptance=[a / v if v else 0.0 for a, v in zip(spec.accepted, spec.verified, strict=True)]
                if spec else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("-k", type=int, default=3)
    args = parser.parse_args()
    sizes, max_tokens, repeats = ((1, 2), 8, 1) if args.smoke else ((1, 4, 16), 48, 3)
    out = args.out or (Path(tempfile.mkdtemp()) / "speculative.json" if args.smoke
                       else Path(__file__).parent / "results" / "speculative.json")
    with tempfile.TemporaryDirectory() as tmp:
        assistant = untrained_assistant(args.model, Path(tmp) / "assistant")
        rows = []
        for n in sizes:
            plain = run(args.model, None, n, max_tokens, args.k, repeats)
            fast = run(args.model, assistant, n, max_tokens, args.k, repeats)
            if fast["tokens"] != plain["tokens"]:
                print(f"N={n}: tokens differ with speculation", file=sys.stderr)
                return 1
            rows += [plain, fast]
    print(f"{'N':>3} {'speculation':>11} {'tok/s':>8} {'steps':>6}  acceptance per draft position")
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance"])
        print(f"{r['n']:>3} {'on' if r['speculative'] else 'off':>11} {r['tok_s']:>8.1f} {r['steps']:>6}  {acc}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
