"""`mmserve perf`: what one step of a model costs per GPU, from its Hugging Face config alone.

Operators use it to sanity-check the MFU/MBU the server reports and to compare with other tools
(`--accounting upper-bound` bills attention like estimators that ignore the mask). With
`--speculative-model` it bills the drafting after the step as the server does: every request that
samples drafts K rows (`--num-speculative-tokens`) over the target's keys before its next token
(CONTEXT_LEN when the step kept every draft, else the 4th field of --request); a verify chunk is a
decode request of 1 + K tokens. At --tp > 1 it lists the bytes each GPU sends per collective site
(comm bytes: ring algorithms, the module docstring of mmserve.metrics.perf_model), apart from the
HBM bytes MBU divides.

With --kv-cache-gib it also prints how the KV planner splits that much memory between the layer
types' pools (core/kv_cache/planner.py): the tokens each pool holds and how many requests of the full
context fit, for --max-num-seqs requests running at once and steps of --max-step-tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from mmserve.config import PERF_ACCOUNTING_CHOICES, EngineConfig
from mmserve.core.kv_cache.planner import GiB, KVCachePlan, KVCacheTooSmall, plan_pools
from mmserve.errors import MMServeError
from mmserve.metrics.peaks import known_devices, lookup, utilization
from mmserve.metrics.perf_model import (
    DraftWork,
    PerfModel,
    RequestWork,
    StepContext,
    VisionWork,
)
from mmserve.model.assistant_spec import read_assistant_spec
from mmserve.model.spec import load_spec_without_transformers

REQUEST_FORM = "NUM_TOKENS:CONTEXT_LEN:prefill|decode[:DRAFT_KEYS]"


@dataclass(frozen=True)
class PerfRequest:
    """One --request: its share of the step, and the keys its drafting reads (None: CONTEXT_LEN)."""

    work: RequestWork
    draft_keys: int | None = None


def parse_request(text: str) -> PerfRequest:
    """NUM_TOKENS:CONTEXT_LEN:prefill|decode[:DRAFT_KEYS] -> PerfRequest."""
    try:
        tokens, context, phase, *keys = text.split(":")
        if phase not in ("prefill", "decode") or len(keys) > 1:
            raise ValueError(phase)
        request = PerfRequest(RequestWork(int(tokens), int(context), phase == "prefill"),
                              int(keys[0]) if keys else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--request {text!r}: expected {REQUEST_FORM}") from None
    work = request.work
    if not 0 < work.num_tokens <= work.context_len:
        raise argparse.ArgumentTypeError(f"--request {text!r}: need 0 < NUM_TOKENS <= CONTEXT_LEN")
    if request.draft_keys is not None and not 0 < request.draft_keys <= work.context_len:
        raise argparse.ArgumentTypeError(f"--request {text!r}: need 0 < DRAFT_KEYS <= CONTEXT_LEN")
    return request


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("perf", help="FLOPs and bytes of one step per GPU, from a HF config",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-config", required=True, help="Gemma 4 family checkpoint directory or config.json")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="weights' and activations' dtype: sets the bytes moved (default bfloat16)")
    p.add_argument("--accounting", default="exact", choices=list(PERF_ACCOUNTING_CHOICES),
                   help="attention core: pairs the mask keeps, or num_tokens * context_len")
    p.add_argument("--request", action="append", type=parse_request, default=[], metavar=REQUEST_FORM,
                   help="one request of the step (repeatable); DRAFT_KEYS: the keys its drafting reads "
                        "(with --speculative-model; default CONTEXT_LEN, every draft kept)")
    p.add_argument("--frames", type=int, default=0, help="video frames the vision encoder runs this step")
    p.add_argument("--patches-per-frame", type=int, default=0, help="patches per frame (default: the model's full budget)")
    p.add_argument("--device", default="", help="GPU name for MFU/MBU, e.g. H100 (with --step-time-ms)")
    p.add_argument("--step-time-ms", type=float, default=0.0, help="measured step time, to print MFU/MBU")
    p.add_argument("--speculative-model", default="", metavar="DIR",
                   help="a Gemma 4 assistant checkpoint directory or its config.json: bill each sampling request's "
                        "drafting (drafter.*)")
    p.add_argument("--num-speculative-tokens", type=int, default=3, metavar="K",
                   help="draft steps per sampling request with --speculative-model (default 3, as the server)")
    p.add_argument("--kv-cache-gib", type=float, default=0.0, metavar="GIB",
                   help="also (or only, without --request) print the KV planner's split of this much memory: "
                        "blocks, bytes and tokens per pool, requests of the full context that fit")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once, for --kv-cache-gib")
    p.add_argument("--max-step-tokens", type=int, default=2048,
                   help="the most tokens one step schedules (the larger step budget), for --kv-cache-gib")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block, for --kv-cache-gib")
    p.add_argument("--max-model-len", type=int, default=0, help="context length cap for --kv-cache-gib; 0 = the model's")
    p.add_argument("--window-cache-share", type=float, default=EngineConfig.window_cache_share,
                   help="the server's --window-cache-share, for --kv-cache-gib (0: prefix caching off)")
    p.add_argument("--json", action="store_true", help="print one JSON object: flops/read_bytes/write_bytes/comm_bytes, "
                   "mfu/mbu/peak_flops/peak_bandwidth with --device and --step-time-ms, and kv_plan with --kv-cache-gib")
    p.set_defaults(func=run)


def kv_plan(spec, *, gib: float, max_num_seqs: int, max_step_tokens: int, block_size: int, max_model_len: int,
            num_speculative_tokens: int = 0, dtype_bytes: int = 2,
            window_cache_share: float = EngineConfig.window_cache_share) -> KVCachePlan:
    """The planner's split of `gib` GiB for `spec` (as the engine plans it with prefix caching on,
    without the runner's per-block overhead, which only a profile on the device measures)."""
    return plan_pools(spec.kv_layer_types, spec.attention_specs, block_size=block_size, dtype_bytes=dtype_bytes,
                      kv_cache_bytes=int(gib * GiB), max_num_seqs=max_num_seqs, max_step_tokens=max_step_tokens,
                      max_model_len=max_model_len or spec.max_model_len, num_speculative_tokens=num_speculative_tokens,
                      window_cache_share=window_cache_share)


def kv_plan_dict(plan: KVCachePlan, block_size: int, max_model_len: int) -> dict:
    tokens = plan.pool_tokens(block_size)
    return {"pools": {t: {"blocks": p.num_blocks - 1, "bytes": p.num_blocks * p.bytes_per_block, "tokens": tokens[t],
                          "window": p.window} for t, p in plan.pools.items()},
            "full_context_requests": plan.full_context_requests(block_size, max_model_len),
            "max_num_seqs": plan.max_num_seqs, "unused_bytes": plan.unused_bytes, "max_model_len": max_model_len}


def write_kv_plan(out, plan: dict, gib: float, args: argparse.Namespace) -> None:
    out.write(f"  KV cache {gib:g} GiB, block {args.block_size}, {args.max_num_seqs} running, "
              f"{args.max_step_tokens}-token steps, max_model_len {plan['max_model_len']}:\n")
    width = max(len(t) for t in plan["pools"])
    for t, p in plan["pools"].items():
        held = ("full contexts" if p["window"] is None
                else f"windows of {plan['max_num_seqs']} requests + one step + cached prefixes' windows")
        out.write(f"    {t:<{width}} {p['blocks']:>9} blocks {p['bytes'] / GiB:8.2f} GiB {p['tokens']:>10} tokens ({held})\n")
    out.write(f"    {plan['full_context_requests']} requests of {plan['max_model_len']} tokens fit; "
              f"{plan['max_num_seqs']} run at once\n")


def run(args: argparse.Namespace) -> int:
    try:
        spec = load_spec_without_transformers(args.hf_config)
    except MMServeError as exc:
        print(f"mmserve perf: {exc}", file=sys.stderr)
        return 2
    if not (args.request or args.kv_cache_gib):
        print("mmserve perf: give --request (a step's cost) or --kv-cache-gib (the KV planner's split)", file=sys.stderr)
        return 2
    plan = None
    if args.kv_cache_gib:
        max_len = args.max_model_len or spec.max_model_len
        try:
            plan = kv_plan_dict(kv_plan(spec, gib=args.kv_cache_gib, max_num_seqs=args.max_num_seqs,
                                        max_step_tokens=args.max_step_tokens, block_size=args.block_size,
                                        max_model_len=max_len, dtype_bytes=2 if args.dtype != "float32" else 4,
                                        num_speculative_tokens=args.num_speculative_tokens if args.speculative_model else 0,
                                        window_cache_share=args.window_cache_share),
                                args.block_size, max_len)
        except (KVCacheTooSmall, ValueError) as exc:
            print(f"mmserve perf: {exc}", file=sys.stderr)
            return 2
        if not args.request:
            if args.json:
                json.dump({"kv_plan": plan}, sys.stdout, indent=2, sort_keys=True)
                sys.stdout.write("\n")
            else:
                sys.stdout.write(f"{spec.model_type}: {spec.num_layers} layers, {args.dtype}:\n")
                write_kv_plan(sys.stdout, plan, args.kv_cache_gib, args)
            return 0
    drafter, drafts = None, ()
    if args.speculative_model:
        if args.num_speculative_tokens < 1:
            print("mmserve perf: --num-speculative-tokens must be at least 1", file=sys.stderr)
            return 2
        try:
            path = Path(args.speculative_model)
            drafter = read_assistant_spec(path.parent if path.name == "config.json" else path)
        except (MMServeError, ValueError) as exc:
            print(f"mmserve perf: {exc}", file=sys.stderr)
            return 2
        drafts = tuple(DraftWork(args.num_speculative_tokens, r.draft_keys or r.work.context_len)
                       for r in args.request if r.work.samples)
    peaks = None
    if args.step_time_ms or args.device:   # MFU/MBU: a measured step time on a known GPU
        if not (args.step_time_ms and args.device):
            print("mmserve perf: MFU/MBU need both --device and --step-time-ms", file=sys.stderr)
            return 2
        peaks = lookup(args.device, args.dtype)
        if peaks is None:
            print(f"mmserve perf: no peak table entry for {args.device!r}; known: {', '.join(known_devices())}",
                  file=sys.stderr)
            return 2
    model = PerfModel(spec, dtype=args.dtype, tp=args.tp, pp=args.pp, accounting=args.accounting, drafter=drafter)
    images: tuple[VisionWork, ...] = ()
    if args.frames:
        if spec.vision is None:
            print(f"mmserve perf: {args.hf_config} has no vision encoder; drop --frames", file=sys.stderr)
            return 2
        images = (VisionWork(args.patches_per_frame or spec.vision.default_patches),) * args.frames
    breakdown = model.step(StepContext(tuple(r.work for r in args.request), images, drafts=drafts), per_gpu=True)
    use = None
    if peaks is not None:
        seconds = args.step_time_ms / 1e3
        use = {"mfu": utilization(breakdown.total_flops, seconds, peaks.flops, "MFU"),
               "mbu": utilization(breakdown.total_bytes, seconds, peaks.bandwidth, "MBU"),
               "peak_flops": peaks.flops, "peak_bandwidth": peaks.bandwidth}
    if args.json:
        json.dump({**breakdown.as_dict(), **(use or {}), **({"kv_plan": plan} if plan else {})}, sys.stdout,
                  indent=2, sort_keys=True)
        sys.stdout.write("\n")
        return 0
    out = sys.stdout
    drafting = f", drafter K={args.num_speculative_tokens}" if drafter is not None else ""
    out.write(f"{spec.model_type}: {spec.num_layers} layers, tp={args.tp} pp={args.pp}, {args.dtype}, "
              f"{args.accounting} attention{drafting}; per GPU:\n")
    sections = [("FLOPs", breakdown.flops), ("read bytes", breakdown.read_bytes), ("write bytes", breakdown.write_bytes)]
    if args.tp > 1:
        sections.append(("comm bytes sent (interconnect, not in MBU)", breakdown.comm_bytes))
    for title, items in sections:
        out.write(f"  {title}: {sum(items.values()):.4g}\n")
        width = max([28, *map(len, items)])
        for key in sorted(items):
            out.write(f"    {key:<{width}} {items[key]:.4g}\n")
    out.write(f"  attention core FLOPs: sliding {breakdown.attn_flops_sliding:.4g}, full {breakdown.attn_flops_full:.4g}\n")
    if use is not None:
        out.write(f"  MFU {100 * use['mfu']:.1f}%  MBU {100 * use['mbu']:.1f}%  (peaks {use['peak_flops']:.4g} FLOP/s, "
                  f"{use['peak_bandwidth']:.4g} B/s)\n")
    if plan is not None:
        write_kv_plan(out, plan, args.kv_cache_gib, args)
    return 0
