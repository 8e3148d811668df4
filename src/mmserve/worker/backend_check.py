"""Start-up self-check of the selected GPU kernels: a GPU unlike the ones tested gets a working
server and a WARNING, not a crash on its first request (vLLM's Gemma 4 threads are full of FA4 and
CUDA-graph start-up crashes: vllm#47275, vllm#48093).

Attention: each layer type on a checked backend (fa4, flex) runs two steps on the pool's real shapes
and on the runner's own KV cache (so the kernels compiled here are the ones serving runs: the check
is also their warm-up): a prefill chunk with frames beside two decodes, then frame-free decodes.
Each is compared with the dense float32 reference on the same (dtype-rounded) inputs. A compile or
launch error, or a max error over the reference's largest value above BF16_TOLERANCE, falls back
along FALLBACK (fa4 -> flex -> sdpa), checking the fallback in turn. CUDA graphs: after capture,
for each query length, a step of real-looking requests on private blocks (`graph_check_step`: a
context of their own, one request short of the graph's size so padding runs beside them) runs as
the padded graph and eagerly unpadded, and their rows are compared (model_runner.py); a failed
capture or a mismatch runs those steps eagerly. E2B/E4B's PLE projection kernel (a Triton GEMM
of our own, model/ple_kernels.py): against the float32 GEMM at decode row counts; a failure turns it
off (cuBLAS). The sampler's top-p kernel (sample/nucleus_kernels.py): against the nucleus's
definition on random rows; a failure turns it off (torch's bisection). `--strict-backends` turns
every fallback into a start-up error.
Results go to GetModelInfo (`backend_checks`) and the `mmserve_backend_info` metric.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import torch

from mmserve.attention import PoolConfig, create_builder, create_impl
from mmserve.config import BACKEND_SELF_CHECK_CHOICES
from mmserve.errors import MMServeError

logger = logging.getLogger(__name__)

FALLBACK = {"fa4": "flex", "flex": "sdpa"}   # checked backends and what runs when one fails
BF16_TOLERANCE = 2e-2


class BackendCheckError(MMServeError):
    """A selected backend failed its start-up check and --strict-backends forbids the fallback."""


@dataclass(frozen=True)
class BackendCheck:
    component: str    # a layer type, "cuda_graphs", "piecewise_graphs", "ple_projection" or "top_p"
    selected: str     # what load time chose
    running: str      # what runs after the check
    reason: str = ""  # why it fell back; "" when the selected one passed

    @property
    def fell_back(self) -> bool:
        return self.running != self.selected


def merge_checks(first: list[BackendCheck], later: list[BackendCheck]) -> list[BackendCheck]:
    """One record per component over two runners' checks (a profiling runner's, then the serving
    one's): the first that fell back, else the later one; the later's components not checked first follow."""
    out = {c.component: c for c in first}
    for c in later:
        if not out.get(c.component, c).fell_back:
            out[c.component] = c
    return list(out.values())


def should_check(mode: str, device: torch.device) -> bool:
    """auto: on CUDA, where the kernels differ from what CPU tests cover; on: also elsewhere."""
    if mode not in BACKEND_SELF_CHECK_CHOICES:
        raise ValueError(f"--backend-self-check {mode!r}: choose from {', '.join(BACKEND_SELF_CHECK_CHOICES)}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def fallen_back(component: str, selected: str, running: str, reason: str, strict: bool) -> BackendCheck:
    """Log (or, strict, raise) a failed check; the record of what runs instead."""
    message = f"{selected} failed its start-up check for {component}: {reason}"
    if strict:
        raise BackendCheckError(f"{message} (--strict-backends: not falling back to {running})")
    logger.warning("%s; falling back to %s", message, running)
    return BackendCheck(component, selected, running, reason)


def check_attention(model, pools: dict[str, PoolConfig], kv_caches: list[torch.Tensor], *,
                    strict: bool) -> list[BackendCheck]:
    """Check every layer type's backend; swap a failing one for its fallback in `model` (impls and
    `attention_backends`), before the runner builds its metadata builders from them."""
    results = []
    for layer_type, selected in list(model.attention_backends.items()):
        if selected not in FALLBACK or layer_type not in pools:
            continue
        cache = next((kv_caches[i] for i, layer in enumerate(model.spec.layers)
                      if layer.layer_type == layer_type and not layer.shares_kv), None)
        if cache is None:   # every layer of the type reads another's cache: nothing of its own to check on
            continue
        running, reasons = selected, []
        while running in FALLBACK:
            reason = attention_mismatch(running, pools[layer_type], cache)
            if reason is None:
                break
            reasons.append(f"{running}: {reason}")
            running = fallen_back(layer_type, running, FALLBACK[running], reason, strict).running
        if running != selected:
            use_backend(model, layer_type, running)
        results.append(BackendCheck(layer_type, selected, running, "; ".join(reasons)))
    return results


PLE_CHECK_ROWS = (2, 17, 64, 256)   # decode/verify row counts: partial and full 16-64-row tiles, the op's limit


def check_ple_kernel(model, *, strict: bool) -> list[BackendCheck]:
    """E2B/E4B on CUDA: PLE's Triton projection (model/ple_kernels.py) against the float32 GEMM of
    the same (dtype-rounded) operand, on the model's own projection weight and fresh random inputs at
    the decode row counts it serves. A launch error or a mismatch turns the kernel off for the process
    (the op then runs the elementwise op and cuBLAS's GEMM: a kernel more per layer, same tokens)."""
    from mmserve.model import ple

    gate_modules = [layer.ple for layer in model.decoder.layers if getattr(layer, "ple", None) is not None]
    if not gate_modules:
        return []
    proj_w = gate_modules[0].per_layer_projection.weight
    reason = ple_kernel_mismatch(proj_w)
    if reason is None:
        ple.use_kernel(True)
        return [BackendCheck("ple_projection", "triton", "triton")]
    ple.use_kernel(False)
    return [fallen_back("ple_projection", "triton", "cublas", reason, strict)]


@torch.no_grad()
def ple_kernel_mismatch(proj_w: torch.Tensor) -> str | None:
    """Why the kernel is wrong on this device for `proj_w` ([H, D]), or None."""
    from mmserve.model.ple import launch_gated_projection

    gen = torch.Generator(device=proj_w.device).manual_seed(0)
    dim = proj_w.shape[1]
    for rows in PLE_CHECK_ROWS:
        gate = torch.randn(rows, dim, generator=gen, device=proj_w.device).mul_(2).to(proj_w.dtype)
        layer_input = torch.randn(rows, 3, dim, generator=gen, device=proj_w.device).to(proj_w.dtype)[:, 1]
        operand = (torch.nn.functional.gelu(gate.float(), approximate="tanh") * layer_input.float()).to(proj_w.dtype)
        want = operand.float() @ proj_w.float().T
        try:
            got = launch_gated_projection(gate, layer_input, proj_w)
        except Exception as exc:   # a compile or launch error on a GPU unlike the ones tested
            return f"{rows} rows: {type(exc).__name__}: {exc}"[:500]
        error = _relative_error(got, want)
        if not error <= BF16_TOLERANCE:   # NaN fails too
            return f"{rows} rows: max error {error:.3g} of the largest value (tolerance {BF16_TOLERANCE})"
    return None


NUCLEUS_CHECK_ROWS = (1, 4)   # one program per row: one row, and programs side by side
NUCLEUS_TOLERANCE = 1e-5      # float32 sums of a row in another order


def check_nucleus_kernel(vocab: int, device: torch.device, *, strict: bool) -> list[BackendCheck]:
    """On CUDA: the top-p kernel (sample/nucleus_kernels.py) on fresh random rows of the model's
    vocabulary, against the definition of the nucleus. A launch error or a wrong set turns it off for
    the process (the sampler then bisects with torch ops: the same sets, ~240 launches more a step
    where a row asks for top-p). It is also the kernel's compile, before the first request."""
    from mmserve.sample import nucleus

    reason = nucleus_kernel_mismatch(vocab, device)
    nucleus.use_kernel(reason is None)
    if reason is None:
        return [BackendCheck("top_p", "triton", "triton")]
    return [fallen_back("top_p", "triton", "torch", reason, strict)]


@torch.no_grad()
def nucleus_kernel_mismatch(vocab: int, device: torch.device) -> str | None:
    """Why the kernel is wrong on this device, or None. Each row's output must be its probabilities
    at or above some t and zeros below, where mass(>= t) reaches top_p and mass(> t) does not (to
    NUCLEUS_TOLERANCE); a row not asked for must be left as it was."""
    from mmserve.sample.nucleus import launch_nucleus_filter

    gen = torch.Generator(device=device).manual_seed(0)
    for rows in NUCLEUS_CHECK_ROWS:
        probs = torch.softmax(torch.randn(rows + 1, vocab, generator=gen, device=device) * 4, dim=-1)
        top_p = torch.rand(rows, generator=gen, device=device) * 0.9 + 0.05
        got = probs.clone()
        try:
            launch_nucleus_filter(got, torch.arange(1, rows + 1, device=device), top_p)
        except Exception as exc:   # a compile or launch error on a GPU unlike the ones tested
            return f"{rows} rows: {type(exc).__name__}: {exc}"[:500]
        kept, asked = got[1:], probs[1:]
        t = torch.where(kept > 0, kept, torch.inf).amin(dim=-1, keepdim=True)
        exact = torch.equal(kept, torch.where(asked >= t, asked, 0.0)) and torch.equal(got[0], probs[0])
        wide = asked.double()
        kept_reaches = wide.where(asked >= t, 0.0).sum(-1) >= top_p.double() - NUCLEUS_TOLERANCE
        above_falls_short = wide.where(asked > t, 0.0).sum(-1) < top_p.double() + NUCLEUS_TOLERANCE
        if not (exact and bool((kept_reaches & above_falls_short).all())):
            return f"{rows} rows: a row's kept tokens are not its nucleus"
    return None


def use_backend(model, layer_type: str, name: str) -> None:
    spec = model.spec.attention_specs[layer_type]
    impl = create_impl(name, spec)
    for layer in model.decoder.layers:
        if layer.layer_type == layer_type:
            layer.self_attn.impl = impl
    model.attention_backends[layer_type] = name


def attention_mismatch(name: str, pool: PoolConfig, cache: torch.Tensor) -> str | None:
    """Why backend `name` is not fit to serve this pool (an error or a mismatch), or None."""
    from mmserve.attention.synthetic import Req, frames

    steps = [[Req(0, 40, frames(4, 2, 12, 4)), Req(50, 1), Req(21, 1)], [Req(70, 1), Req(33, 1)]]
    for reqs in steps:
        if sum(r.query for r in reqs) > pool.max_num_tokens or len(reqs) > pool.max_num_reqs:
            continue
        try:
            err = _step_error(name, pool, cache, reqs)
        except Exception as exc:   # a compile or launch error: the whole point is to survive it
            logger.debug("start-up check of %s", name, exc_info=True)
            return f"{type(exc).__name__}: {str(exc)[:300]}"
        if not err <= BF16_TOLERANCE:   # NaN fails too
            return f"max error {err:.3g} of the reference's largest value (tolerance {BF16_TOLERANCE})"
    return None


def _step_error(name: str, pool: PoolConfig, cache: torch.Tensor, reqs) -> float:
    from mmserve.attention.synthetic import make_batch

    spec = pool.spec
    blocks = sum(-(-r.seq_len // pool.block_size) for r in reqs) + 2
    if blocks > pool.num_blocks:
        return 0.0   # a pool this small serves nothing either; the first request will tell
    batch = make_batch(reqs, spec, block_size=pool.block_size, num_blocks=blocks,
                       table_width=pool.max_blocks_per_req, gen=torch.Generator().manual_seed(0))
    rounded = [t.to(pool.dtype) for t in (batch.q, batch.k, batch.v, batch.kv_cache)]
    reference_batch = replace(batch, q=rounded[0].float(), k=rounded[1].float(), v=rounded[2].float(),
                              kv_cache=rounded[3].float())
    want = _run("reference", replace(pool, device=torch.device("cpu"), dtype=torch.float32), reference_batch,
                reference_batch.kv_cache.clone())
    md = batch.metadata
    on_device = {f: getattr(md, f).to(pool.device) for f in ("query_start_loc", "seq_lens", "positions",
                                                             "block_table", "slot_mapping", "query_ranges")
                 if getattr(md, f) is not None}
    q, k, v = (t.to(pool.device) for t in rounded[:3])
    try:
        cache[:, :blocks].copy_(rounded[3])
        got = _run(name, pool, replace(batch, q=q, k=k, v=v, metadata=replace(md, **on_device)), cache)
        got = got[: md.num_actual_tokens].float().cpu()
    finally:
        cache[:, :blocks].zero_()   # leave the cache as the runner made it
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))


def _run(name: str, pool: PoolConfig, batch, cache: torch.Tensor) -> torch.Tensor:
    metadata = create_builder(name, pool).build(batch.metadata)
    return create_impl(name, pool.spec).forward(batch.q, batch.k, batch.v, cache, metadata)


@dataclass
class CheckStep:
    """A step of real-looking requests for the graph check: each has a context of its own on private
    blocks (blocks 1.., never the null block) and schedules `query_len` tokens (a verify chunk's
    last token and drafts when above one)."""

    scheduled: list
    tables: dict[str, np.ndarray]   # per pool: one table row per request (the runner's layout)
    rows: np.ndarray                # each request's row in `tables`
    blocks: list[int]               # every block the step's requests hold, in every pool


def graph_check_step(query_lens: list[int], *, pools: dict[str, PoolConfig], vocab_size: int,
                     max_model_len: int, seed: int = 0) -> CheckStep | None:
    """Requests scheduling `query_lens` tokens each, over contexts of one to a few blocks (partial
    ones included), or None when some pool has too few blocks (a pool this small serves nothing
    either; the first request will tell)."""
    from mmserve.core.sched.output import ScheduledRequest
    from mmserve.request import Request
    from mmserve.sampling_params import SamplingParams

    pool = next(iter(pools.values()))
    bs, width = pool.block_size, pool.max_blocks_per_req
    rng = np.random.default_rng(seed)
    num_reqs = len(query_lens)
    scheduled, tables, blocks = [], {t: np.zeros((num_reqs, width), dtype=np.int32) for t in pools}, []
    for i, query_len in enumerate(query_lens):
        context = min(max_model_len - query_len, bs * (i + 1) + 2 * i + 1)
        if context < 0:
            return None
        own = list(range(len(blocks) + 1, len(blocks) + 1 + -(-(context + query_len) // bs)))
        blocks += own
        for table in tables.values():
            table[i, :len(own)] = own
        prompt = rng.integers(0, vocab_size, context + 1).tolist()
        drafts = rng.integers(0, vocab_size, query_len - 1).tolist()
        request = Request(f"graph-check-{i}", prompt, SamplingParams(max_tokens=query_len))
        scheduled.append(ScheduledRequest(request, num_tokens=query_len, num_computed_tokens=context,
                                          is_prefill=False, draft_token_ids=drafts))
    if any(len(blocks) >= p.num_blocks for p in pools.values()):
        return None
    return CheckStep(scheduled, tables, np.arange(num_reqs), blocks)


@contextmanager
def check_cache(kv_caches: list[torch.Tensor], step: CheckStep):
    """Random context K/V in the check step's private blocks and garbage in the null block while
    it runs; `garbage(again)` restores the context (a step rewrites its own slots) and, again,
    puts other garbage in the null block. The cache is as the runner made it afterwards."""
    caches = list({c.data_ptr(): c for c in kv_caches}.values())
    used = torch.tensor([0, *step.blocks], device=caches[0].device)
    saved = [c[:, used].clone() for c in caches]
    gen = torch.Generator().manual_seed(0)

    def random_like(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen).mul_(0.5).to(t)
    try:
        for c in caches:
            c[:, used] = random_like(c[:, used])
        context = [c[:, used].clone() for c in caches]

        def garbage(again: bool) -> None:
            for c, ctx in zip(caches, context, strict=True):
                c[:, used] = ctx
                if again:
                    c[:, 0] = random_like(c[:, 0])
        yield garbage
    finally:
        for c, s in zip(caches, saved, strict=True):
            c[:, used] = s


def graphs_mismatch(replayed: torch.Tensor, eager: torch.Tensor, padding: torch.Tensor,
                    padding_again: torch.Tensor) -> str | None:
    """Why a graph replay is not fit to serve, or None: its real rows (`replayed`) must match the eager
    forward's (`eager`, the same requests unpadded), NaN where the other is NaN; its padding rows must
    be finite and the same in a second replay over other garbage in the null block (`padding_again`):
    padding reads only what it writes itself, and leaves its K/V in the null block, which a kernel
    tile may load beside a real row's keys."""
    nan = replayed.isnan()
    if not torch.equal(nan, eager.isnan()):
        return "graph replay and eager forward disagree on which outputs are NaN"
    if not bool(padding.isfinite().all() and padding_again.isfinite().all()):
        return "a graph replay's padding rows are not finite"
    if (err := _relative_error(padding_again, padding)) > BF16_TOLERANCE:
        return f"a graph replay's padding rows depend on what the null block held: max error {err:.3g}"
    if (err := _relative_error(replayed[~nan], eager[~nan])) > BF16_TOLERANCE:
        return f"graph replay differs from the eager forward: max error {err:.3g}"
    return None


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if want.numel() == 0:
        return 0.0
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6))
