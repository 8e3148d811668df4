"""Analytic FLOPs and bytes of one engine step, per component, globally and per GPU.

Why analytic: measuring FLOPs on the GPU is not possible cheaply, and MFU/MBU need a numerator that
is right for hybrid models. Known estimators bill sliding layers the whole context (8-30x too much at
long context), floor layers per pipeline stage, use one head_dim for every layer, and forget the vision
encoder. Here every layer kind keeps its own heads, head_dim, window and K=V flag; sliding layers clamp
each request to its window; pipeline stages divide each kind's count as a fraction; the vision
encoder is a component of its own.

Conventions (documented in docs/tracing.md):
- a matmul [m, k] x [k, n] costs 2*m*k*n FLOPs; norms, rotary, softmax and activations are not billed.
- attention core per layer and head: attn_qk = attn_av = 2 * head_dim * pairs, pairs counted
  `exact` (kept by the mask, frames' bidirectional pairs included) or `upper-bound`
  (num_tokens * context_len, clamped to the window on sliding layers).
- bytes: weights once per step, activations once per producer/consumer, K/V of the distinct keys a
  request's queries touch, read from the cache at the cache dtype.
- KV-sharing layers (Gemma 4 E-models) project only Q and write no cache; they read the
  producer's cache like any layer reads its own, and run only the rows that sample (a prefill
  chunk's rows that sample nothing feed nothing after the last layer that writes KV).
- MoE (Gemma 4 26B-A4B): the router, each token's top_k expert MLPs and the dense MLP beside them;
  expert weights are read once per distinct expert the step touches: the count the model
  reported when the step context has it, else the upper bound min(num_experts, tokens * top_k).
- KV-sharing layers run every row of a step that holds a verify chunk (a decode request of 1 + K
  tokens: the runner then takes the full path, worker/model_runner.py); a step with prompt
  logprobs does too, which the step context does not say (billed as the sampled rows; the extra
  logits rows of prompt logprobs are not billed either, nor their all-gathers).
- per-layer embeddings (E2B/E4B): the model-level projection (first stage) and each layer's gate
  and projection; the token table is a gather (bytes of the rows read, no FLOPs). Under tp the
  table and the projection are split along the per-layer width (model/ple.py), the gates are not.
- the speculative drafter (Gemma 4 assistant, its own "drafter" component): per draft step, the
  rows that drafted through pre_projection, its layers (Q only, over the target's K/V: the keys
  before the drafted-from token, the last window + 1 on sliding layers), the MLP, the head (tied or
  centroid) and post_projection; its weights and those keys are read once per draft step. Verify
  rows are ordinary target rows (a decode request's num_tokens). Per GPU it is split as the
  engine shards it (model/assistant.py): heads, MLP width and the head's vocabulary rows (the
  centroid head's selected rows, on average) divide by tp; the projections and centroids do not.
- per GPU = one average GPU of tp * pp: heads, FFN width, experts' width, vocab and the PLE width
  divide by tp (KV heads never below 1, they are replicated); what the engine replicates on every
  rank is billed whole on every GPU: the vision encoder (model/loader.py: every rank encodes), the
  router, the PLE gates, the drafter's projections and centroids. Layer counts, the vision encoder
  (first stage) and the unembedding (last stage) divide by pp, so per-GPU figures times the stage
  count give the whole model.
- communication (`comm_bytes`, component "comm"; per GPU at tp > 1 only, none in the whole-model
  view, which is one device): the bytes one GPU sends over the interconnect for each collective our
  code calls (model/parallel.py), per call site. A collective's payload N is the tensor it moves,
  in the dtype it has there (activations in the model dtype; logits are gathered before `.float()`;
  draft token ids are int64); an all-gather's N is the gathered size. Under ring algorithms a GPU
  sends 2(tp-1)/tp * N per all-reduce (reduce-scatter, then all-gather), (tp-1)/tp * N per
  all-gather, and for a broadcast the (tp-1) * N the group sends in all, averaged over its tp GPUs:
  (tp-1)/tp * N (`sent_per_gpu`). Sites: `comm.embed_all_reduce` (vocab-parallel lookup, every row),
  `comm.o_proj_all_reduce` and `comm.mlp_all_reduce` (per layer, the rows it runs),
  `comm.moe_all_reduce` (routed experts), `comm.ple_all_gather` (token and context parts, [2, T, L, P]),
  `comm.logits_all_gather` (the sampled rows); the drafter's per draft step
  `comm.drafter_embed_all_reduce` (the target's embedding of the drafted-from tokens),
  `comm.drafter_o_proj_all_reduce`, `comm.drafter_mlp_all_reduce`, `comm.drafter_logits_all_gather`
  (tied head) or `comm.drafter_centroid_scores_all_reduce` (the selected rows' scores), and
  `comm.drafter_token_broadcast` when a drafting request is constrained (rank 0's masked drafts).
  Not in the bytes MBU divides (those are HBM traffic). Not billed: the step's plain-data message
  from rank 0 (pickled scheduler output, pixels once; executor/tensor_parallel.py), pipeline stages'
  sends, a CUDA graph's padding rows.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mmserve.attention.backend import LayerAttentionSpec
from mmserve.config import PERF_ACCOUNTING_CHOICES
from mmserve.metrics.attention_pairs import kept_pairs, keys_touched
from mmserve.model.spec import AudioSpec, ModelSpec, MoeSpec, VisionSpec

if TYPE_CHECKING:
    from mmserve.model.assistant_spec import AssistantSpec

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
LOGITS_BYTES = 4  # logits are produced in float32 (soft-capping and sampling need it)
TOKEN_ID_BYTES = 8  # int64 token ids (the argmax of a draft step)
RING_SENT = {"all_reduce": 2.0, "all_gather": 1.0, "broadcast": 1.0}   # x (tp - 1) / tp of the payload


def sent_per_gpu(kind: str, payload: float, tp: int) -> float:
    """Bytes one GPU of `tp` sends for a collective of `kind` moving `payload` bytes (module docstring)."""
    return RING_SENT[kind] * (tp - 1) / tp * payload


@dataclass(frozen=True)
class RequestWork:
    """One request's share of a step: `num_tokens` new tokens ending at context length `context_len`.

    `mm_ranges` are the request's inclusive absolute [start, end] frame/image ranges (needed only for
    exact bidirectional pair counts); `samples` says whether the step samples a token for it (every
    decode token; a prefill chunk only when it is the prompt's last).
    """

    num_tokens: int
    context_len: int
    is_prefill: bool
    mm_ranges: tuple[tuple[int, int], ...] = ()
    samples: bool = True

    @property
    def num_logits(self) -> int:
        if not self.samples:
            return 0
        return 1 if self.is_prefill else self.num_tokens


def _sampled_rows(r: RequestWork) -> RequestWork:
    """The rows of a request's chunk that a KV-sharing layer runs: every decode token, a prefill
    chunk's last token (the one that samples)."""
    if not r.is_prefill:
        return r
    return RequestWork(1, r.context_len, True, r.mm_ranges, r.samples)


@dataclass(frozen=True)
class VisionWork:
    """One image or video frame through the vision encoder: patches as run (padding included) and the
    soft tokens it yields (0 = patches / pool_kernel**2)."""

    num_patches: int
    num_tokens: int = 0


@dataclass(frozen=True)
class AudioWork:
    """One audio segment through the audio tower: its log-mel frames as run (padding included) and
    the soft tokens it yields (0 = frames subsampled 4x by the two stride-2 convs)."""

    num_frames: int
    num_tokens: int = 0


@dataclass(frozen=True)
class DraftWork:
    """One request's drafting after the step: `num_rows` draft steps of the assistant, each over the
    target's `num_keys` cached positions before the token it drafts from. `constrained`: its output
    follows a grammar, which rank 0 alone applies (each draft step then broadcasts the drafts)."""

    num_rows: int
    num_keys: int
    constrained: bool = False


@dataclass(frozen=True)
class StepContext:
    """A step's requests, encoded images and drafting; `experts_touched`: distinct experts per MoE
    layer the step routed to (mean over layers), when the model reported it."""

    requests: tuple[RequestWork, ...] = ()
    images: tuple[VisionWork, ...] = ()
    audio: tuple[AudioWork, ...] = ()
    experts_touched: float | None = None
    drafts: tuple[DraftWork, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)


@dataclass
class PerfBreakdown:
    """FLOPs and bytes per "component.item"; attention core FLOPs also split by layer kind;
    `comm_bytes`: bytes sent over the interconnect per collective site (not HBM traffic)."""

    flops: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    read_bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    write_bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    comm_bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    attn_flops_sliding: float = 0.0
    attn_flops_full: float = 0.0
    # (query, key) pairs the mask keeps in one layer of each kind, per head ("exact" accounting only):
    # the least work an attention kernel can do, to compare with what a backend executes.
    kept_pairs_sliding: float = 0.0
    kept_pairs_full: float = 0.0

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())

    @property
    def total_read_bytes(self) -> float:
        return sum(self.read_bytes.values())

    @property
    def total_write_bytes(self) -> float:
        return sum(self.write_bytes.values())

    @property
    def total_bytes(self) -> float:
        """HBM bytes (read + write), what MBU divides; communication is not in it."""
        return self.total_read_bytes + self.total_write_bytes

    @property
    def total_comm_bytes(self) -> float:
        return sum(self.comm_bytes.values())

    TABLES = ("flops", "read_bytes", "write_bytes", "comm_bytes")   # the per-item tables, one place
    TOTALS = ("attn_flops_sliding", "attn_flops_full", "kept_pairs_sliding", "kept_pairs_full")

    def component(self, name: str) -> PerfBreakdown:
        """Only the items of one component ("attn", "ffn", "ple", "unembed", "vision", "audio", "drafter", "comm")."""
        out = PerfBreakdown()
        for table in self.TABLES:
            getattr(out, table).update({k: v for k, v in getattr(self, table).items() if k.split(".", 1)[0] == name})
        if name == "attn":
            out.attn_flops_sliding, out.attn_flops_full = self.attn_flops_sliding, self.attn_flops_full
        return out

    def add(self, part: PerfBreakdown) -> None:
        """Sum `part` into this breakdown (a step's text, vision and drafter parts into one)."""
        for table in self.TABLES:
            into = getattr(self, table)
            for key, value in getattr(part, table).items():
                into[key] += value
        for total in self.TOTALS:
            setattr(self, total, getattr(self, total) + getattr(part, total))

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {table: dict(getattr(self, table)) for table in self.TABLES}


class PerfModel:
    """FLOPs/bytes of a step for one model under a dtype and a tp x pp layout."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        dtype: str = "bfloat16",
        kv_cache_dtype: str | None = None,
        tp: int = 1,
        pp: int = 1,
        accounting: str = "exact",
        drafter: AssistantSpec | None = None,
    ):
        if accounting not in PERF_ACCOUNTING_CHOICES:
            raise ValueError(f"accounting {accounting!r}: choose from {', '.join(PERF_ACCOUNTING_CHOICES)}")
        if tp < 1 or pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
        self.spec = spec
        # Layers that cost the same are billed together: (attention, K=V, shares KV, MLP width, experts).
        self.groups = Counter((spec.attention_specs[layer.layer_type], layer.k_eq_v, layer.shares_kv,
                               layer.mlp_width, layer.moe) for layer in spec.layers)
        self.act_bytes = self.weight_bytes = DTYPE_BYTES[dtype]
        self.cache_bytes = DTYPE_BYTES[kv_cache_dtype or dtype]
        self.tp, self.pp, self.accounting = tp, pp, accounting
        self.drafter = drafter

    def step(self, ctx: StepContext, *, per_gpu: bool = False) -> PerfBreakdown:
        """The step's breakdown: whole model, or one average GPU when `per_gpu`."""
        out = PerfBreakdown()
        tp, pp = (self.tp, self.pp) if per_gpu else (1, 1)
        tokens = ctx.num_tokens
        if tokens:
            # KV-sharing layers run only the rows that sample (see decoder.SampledRows), unless a
            # verify chunk makes the runner take the full path
            verify = any(not r.is_prefill and r.num_tokens > 1 for r in ctx.requests)
            sampled = ctx.requests if verify else tuple(_sampled_rows(r) for r in ctx.requests if r.num_logits)
            caches: dict[bool, dict[tuple, tuple[int, int]]] = {False: {}, True: {}}
            for (attn, k_eq_v, shares_kv, width, moe), count in self.groups.items():
                if shares_kv and not sampled:
                    continue   # no row samples: the KV-sharing layers do not run at all
                layers = count / pp
                rows = sampled if shares_kv else ctx.requests
                self._attention(out, attn, k_eq_v, shares_kv, rows, layers, tp,
                                self._pairs_and_keys(attn, rows, caches[shares_kv]))
                self._ffn(out, width, moe, sum(r.num_tokens for r in rows), ctx.experts_touched, layers, tp)
                if tp > 1:   # o_proj and down_proj row-parallel, the experts' partial sums: [rows, hidden] each
                    activations = sum(r.num_tokens for r in rows) * self.spec.hidden_size * self.act_bytes * layers
                    for site in ("o_proj", "mlp") + (("moe",) if moe is not None else ()):
                        self._comm(out, f"{site}_all_reduce", "all_reduce", activations, tp)
            logits = sum(r.num_logits for r in ctx.requests)
            if self.spec.ple is not None:
                consumers = sum(layer.shares_kv for layer in self.spec.layers)
                self._ple(out, tokens, sum(r.num_tokens for r in sampled), consumers, tp, pp)
            self._unembed(out, logits, tp, pp)
            if tp > 1:
                ba, hidden = self.act_bytes, self.spec.hidden_size
                self._comm(out, "embed_all_reduce", "all_reduce", tokens * hidden * ba / pp, tp)
                if self.spec.ple is not None:
                    self._comm(out, "ple_all_gather", "all_gather",
                               2 * tokens * self.spec.num_layers * self.spec.ple.dim * ba / pp, tp)
                if logits:
                    self._comm(out, "logits_all_gather", "all_gather", logits * self.spec.vocab_size * ba / pp, tp)
        if ctx.images and self.spec.vision is not None:
            self._vision(out, self.spec.vision, ctx.images, pp)
        if ctx.audio and self.spec.audio is not None:
            self._audio(out, self.spec.audio, ctx.audio, pp)
        if ctx.drafts and self.drafter is not None:
            self._drafter(out, self.drafter, ctx.drafts, tp)
        return out

    @staticmethod
    def _comm(out: PerfBreakdown, site: str, kind: str, payload: float, tp: int) -> None:
        out.comm_bytes[f"comm.{site}"] += sent_per_gpu(kind, payload, tp)

    # -- attention ---------------------------------------------------------------------------------

    def _pairs_and_keys(self, a: LayerAttentionSpec, requests: Sequence[RequestWork], cache: dict) -> tuple[int, int]:
        """Σ kept pairs and Σ distinct keys over the step's requests, shared by layers of one kind."""
        key = (a.window, a.bidirectional, a.clamp_bidirectional)
        if key not in cache:
            pairs = keys = 0
            for r in requests:
                if self.accounting == "exact":
                    pairs += kept_pairs(r.num_tokens, r.context_len, a.window, r.mm_ranges,
                                        bidirectional=a.bidirectional, clamp=a.clamp_bidirectional)
                else:
                    pairs += r.num_tokens * (r.context_len if a.window is None else min(r.context_len, a.window))
                keys += keys_touched(r.num_tokens, r.context_len, a.window, r.mm_ranges,
                                     bidirectional=a.bidirectional, clamp=a.clamp_bidirectional)
            cache[key] = (pairs, keys)
        return cache[key]

    def _attention(self, out: PerfBreakdown, a: LayerAttentionSpec, k_eq_v: bool, shares_kv: bool,
                   requests: Sequence[RequestWork], layers: float, tp: int, pairs_keys: tuple[int, int], *,
                   hidden: int | None = None, component: str = "attn") -> None:
        """`layers` layers of one kind; `pairs_keys`: Σ kept (query, key) pairs and Σ distinct keys read.
        The per-kind attention splits are the target's only (component "attn")."""
        hidden = hidden or self.spec.hidden_size
        ba, bw, bc = self.act_bytes, self.weight_bytes, self.cache_bytes
        tokens = sum(r.num_tokens for r in requests)
        q, d = a.num_heads / tp, a.head_dim
        kv = max(1.0, a.num_kv_heads / tp)
        kv_proj = 0.0 if shares_kv else (kv if k_eq_v else 2 * kv)  # projected K/V widths (heads)
        kv_out = 0.0 if shares_kv else 2 * kv                       # K and V produced (V = norm(K) if K=V)
        pairs, keys = pairs_keys
        core = 2 * q * d * pairs * layers
        f, r, w, c = out.flops, out.read_bytes, out.write_bytes, component
        f[f"{c}.qkv_proj"] += 2 * tokens * hidden * (q + kv_proj) * d * layers
        f[f"{c}.attn_qk"] += core
        f[f"{c}.attn_av"] += core
        f[f"{c}.out_proj"] += 2 * tokens * q * d * hidden * layers
        if c == "attn":
            if a.window is not None:
                out.attn_flops_sliding += 2 * core
            else:
                out.attn_flops_full += 2 * core
            # One layer's count, every layer of a kind keeping the same pairs: a KV-sharing layer does
            # not set it, since it runs only the sampling rows (and its group may come last).
            if self.accounting == "exact" and not shares_kv:
                if a.window is not None:
                    out.kept_pairs_sliding = pairs
                else:
                    out.kept_pairs_full = pairs
        r[f"{c}.qkv_input"] += tokens * hidden * ba * layers
        r[f"{c}.qkv_weight"] += hidden * (q + kv_proj) * d * bw * layers
        r[f"{c}.attn_input"] += (tokens * q * d * ba + 2 * keys * kv * d * bc) * layers
        r[f"{c}.out_input"] += tokens * q * d * ba * layers
        r[f"{c}.out_weight"] += q * d * hidden * bw * layers
        w[f"{c}.qkv_output"] += tokens * (q + kv_out) * d * ba * layers
        w[f"{c}.kv_cache"] += tokens * kv_out * d * bc * layers
        w[f"{c}.out_output"] += tokens * hidden * ba * layers

    # -- FFN ---------------------------------------------------------------------------------------

    def _mlp(self, out: PerfBreakdown, prefix: str, tokens: float, width: float, matrices: int,
             weight_copies: float, layers: float, *, hidden: int | None = None, component: str = "ffn") -> None:
        """One (gated) MLP over `tokens` rows; `weight_copies` = how many distinct weight sets are read."""
        hidden, ba, bw = hidden or self.spec.hidden_size, self.act_bytes, self.weight_bytes
        up = matrices - 1  # gate+up (gated) or up only
        prefix = f"{component}.{prefix}"
        out.flops[f"{prefix}ffn"] += 2 * tokens * hidden * width * matrices * layers
        r, w = out.read_bytes, out.write_bytes
        r[f"{prefix}up_gate_input"] += tokens * hidden * ba * layers
        r[f"{prefix}up_gate_weight"] += up * hidden * width * bw * weight_copies * layers
        r[f"{prefix}act_input"] += up * tokens * width * ba * layers
        r[f"{prefix}down_input"] += tokens * width * ba * layers
        r[f"{prefix}down_weight"] += hidden * width * bw * weight_copies * layers
        w[f"{prefix}up_gate_output"] += up * tokens * width * ba * layers
        w[f"{prefix}act_output"] += tokens * width * ba * layers
        w[f"{prefix}down_output"] += tokens * hidden * ba * layers

    def _ffn(self, out: PerfBreakdown, width: int, moe: MoeSpec | None, tokens: int,
             experts_touched: float | None, layers: float, tp: int) -> None:
        self._mlp(out, "dense_", tokens, width / tp, 3, 1.0, layers)
        if moe is None:
            return
        hidden = self.spec.hidden_size
        out.flops["ffn.router"] += 2 * tokens * hidden * moe.num_experts * layers
        out.read_bytes["ffn.router_weight"] += hidden * (moe.num_experts + 1) * self.weight_bytes * layers
        experts_hit = experts_touched if experts_touched is not None else min(moe.num_experts, tokens * moe.top_k)
        self._mlp(out, "routed_", tokens * moe.top_k, moe.intermediate / tp, 3, experts_hit, layers)

    # -- per-layer embeddings ----------------------------------------------------------------------

    def _ple(self, out: PerfBreakdown, tokens: int, sampled: int, consumers: int, tp: int, pp: int) -> None:
        ple, hidden, ba, bw = self.spec.ple, self.spec.hidden_size, self.act_bytes, self.weight_bytes
        n = self.spec.num_layers
        f, r, w = out.flops, out.read_bytes, out.write_bytes
        # model level (first stage): token table rows (a gather) + projection of the main embeddings,
        # both this rank's dim / tp columns; the gathered inputs are whole on every rank
        f["ple.model_projection"] += 2 * tokens * hidden * n * ple.dim / tp / pp
        r["ple.token_rows"] += tokens * n * ple.dim * bw / tp / pp
        r["ple.model_projection_weight"] += hidden * n * ple.dim * bw / tp / pp
        r["ple.model_projection_input"] += tokens * hidden * ba / pp
        w["ple.layer_inputs"] += tokens * n * ple.dim * ba / pp
        # per layer (replicated): gate (hidden -> dim) and projection (dim -> hidden); KV-sharing layers' rows only
        rows = (tokens * (n - consumers) + sampled * consumers) / pp   # Σ over layers of the rows each runs
        f["ple.gate"] += 2 * rows * hidden * ple.dim
        f["ple.projection"] += 2 * rows * ple.dim * hidden
        r["ple.layer_weight"] += 2 * hidden * ple.dim * bw * (n if sampled else n - consumers) / pp
        r["ple.layer_activations"] += rows * (hidden + 2 * ple.dim) * ba
        w["ple.layer_activations"] += rows * (ple.dim + hidden) * ba

    # -- unembedding and vision --------------------------------------------------------------------

    def _unembed(self, out: PerfBreakdown, logits: int, tp: int, pp: int) -> None:
        if not logits:
            return
        hidden, vocab = self.spec.hidden_size, self.spec.vocab_size / tp
        out.flops["unembed.unembed"] += 2 * logits * hidden * vocab / pp
        out.read_bytes["unembed.input"] += logits * hidden * self.act_bytes / pp
        out.read_bytes["unembed.weight"] += hidden * vocab * self.weight_bytes / pp
        out.write_bytes["unembed.output"] += logits * vocab * LOGITS_BYTES / pp

    def _vision(self, out: PerfBreakdown, v: VisionSpec, images: Iterable[VisionWork], pp: int) -> None:
        """The whole encoder on every GPU of a stage: tensor parallelism replicates it."""
        ba, bw = self.act_bytes, self.weight_bytes
        q, kv, d, width = v.num_heads, v.num_kv_heads, v.head_dim, v.intermediate
        f, r, w = out.flops, out.read_bytes, out.write_bytes
        weights_read = False
        for img in images:
            p = img.num_patches
            t = img.num_tokens or p // (v.pool_kernel ** 2)
            n_layers = v.num_layers / pp
            f["vision.patch_embed"] += 2 * p * v.patch_dim * v.hidden / pp
            if v.num_layers:
                f["vision.qkv_proj"] += 2 * p * v.hidden * (q + 2 * kv) * d * n_layers
                f["vision.attn_qk"] += 2 * q * d * p * p * n_layers  # bidirectional over every patch
                f["vision.attn_av"] += 2 * q * d * p * p * n_layers
                f["vision.out_proj"] += 2 * p * q * d * v.hidden * n_layers
                f["vision.mlp"] += 2 * p * v.hidden * width * 3 * n_layers
                # per layer: qkv/out/mlp inputs and the patches' own K/V for the core; outputs likewise
                act = p * (2 * v.hidden + (q + 2 * kv) * d + q * d + 3 * width) * ba * n_layers
                r["vision.activations"] += act
                w["vision.activations"] += act
            if v.pool_kernel > 1:
                f["vision.pool"] += 2 * (p // (v.pool_kernel ** 2)) * p * v.hidden / pp
            f["vision.projector"] += 2 * t * v.hidden * v.projector_out / pp
            r["vision.input"] += p * v.patch_dim * ba / pp
            w["vision.output"] += t * v.projector_out * ba / pp
            weights_read = True
        if weights_read:  # the encoder's weights are read once per step, however many frames it encodes
            per_layer = v.hidden * (q + 2 * kv) * d + q * d * v.hidden + v.hidden * width * 3
            r["vision.weight"] += (per_layer * v.num_layers + v.patch_dim * v.hidden
                                   + v.hidden * v.projector_out) * bw / pp

    def _audio(self, out: PerfBreakdown, a: AudioSpec, segments: Iterable[AudioWork], pp: int) -> None:
        """The audio tower on every GPU of a stage (replicated, like the vision tower): two stride-2
        3x3 convs over the [frames, bins] log-mel grid, then per block two 4x-wide feed-forwards, Q/K/V
        and output projections, chunked local attention (each query sees `context` keys, plus the
        relative-position term over half of them), the light conv (GLU projection, depthwise conv,
        output projection); then the output projection and the embedder's projection to the text width."""
        ba, bw = self.act_bytes, self.weight_bytes
        h, (c0, c1), bins, layers = a.hidden, a.conv_channels, a.feature_size, a.num_layers / pp
        f, r, w = out.flops, out.read_bytes, out.write_bytes
        for seg in segments:
            frames = seg.num_frames
            t = seg.num_tokens or ((frames + 1) // 2 + 1) // 2
            f["audio.subsample"] += (2 * 9 * c0 * ((frames + 1) // 2) * (bins // 2)
                                     + 2 * 9 * c0 * c1 * t * (bins // 4) + 2 * t * (bins // 4) * c1 * h) / pp
            f["audio.ffn"] += 2 * 2 * (2 * t * h * 4 * h) * layers
            f["audio.attn_proj"] += 4 * (2 * t * h * h) * layers
            f["audio.attn_core"] += (2 * 2 * t * a.context * h + 2 * t * (a.context // 2 + 1) * h) * layers
            f["audio.lconv"] += (2 * t * h * 2 * h + 2 * t * h * h + 2 * t * h * a.conv_kernel) * layers
            f["audio.projector"] += (2 * t * h * a.output_dim + 2 * t * a.output_dim * a.projector_out) / pp
            # per block: each matmul's input and output once (FFNs 4x wide), the attention context's K/V
            act = t * h * (2 * 2 * 5 + 2 * 4 + 2 * a.context + 6) * ba * layers
            r["audio.activations"] += act
            w["audio.activations"] += act
            r["audio.input"] += frames * bins * ba / pp
            w["audio.output"] += t * a.projector_out * ba / pp
        per_block = 2 * 2 * h * 4 * h + 5 * h * h + 3 * h * h + h * a.conv_kernel
        r["audio.weight"] += (per_block * a.num_layers + 9 * c0 + 9 * c0 * c1 + (bins // 4) * c1 * h
                              + h * a.output_dim + a.output_dim * a.projector_out) * bw / pp

    # -- speculative drafter -----------------------------------------------------------------------

    def _linear(self, out: PerfBreakdown, key: str, rows: int, k: int, n: int, out_bytes: int | None = None) -> None:
        """rows x [k, n]: its FLOPs, input, weight (read once) and output."""
        out.flops[key] += 2 * rows * k * n
        out.read_bytes[f"{key}_input"] += rows * k * self.act_bytes
        out.read_bytes[f"{key}_weight"] += k * n * self.weight_bytes
        out.write_bytes[f"{key}_output"] += rows * n * (out_bytes or self.act_bytes)

    def _drafter(self, out: PerfBreakdown, a: AssistantSpec, drafts: Sequence[DraftWork], tp: int = 1) -> None:
        """Each draft step batches the requests with a row left (the engine reports every drafting
        request with the round's longest, as its loop runs them); layers reuse the target's formulas."""
        layers = Counter(a.layer_types)
        hidden, backbone = a.hidden_size, a.backbone_hidden_size
        constrained = any(d.constrained for d in drafts)
        for step in range(max(d.num_rows for d in drafts)):
            active = [d for d in drafts if d.num_rows > step]
            rows = len(active)
            if tp > 1:
                self._drafter_comm(out, a, rows, constrained, tp)
            out.read_bytes["drafter.token_rows"] += rows * backbone * self.weight_bytes   # the target's embedding
            self._linear(out, "drafter.pre_projection", rows, 2 * backbone, hidden)
            for t, count in layers.items():
                attn = a.attention[t]
                seen = [d.num_keys if attn.window is None else min(d.num_keys, attn.window + 1) for d in active]
                work = tuple(RequestWork(1, d.num_keys, False) for d in active)
                self._attention(out, attn, False, True, work, count, tp, (sum(seen), sum(seen)),
                                hidden=hidden, component="drafter")
                self._mlp(out, "", rows, a.intermediate_size / tp, 3, 1.0, count, hidden=hidden, component="drafter")
            if a.use_ordered_embeddings:   # centroid scores, then only the top-k centroids' vocabulary rows
                self._linear(out, "drafter.centroids", rows, hidden, a.num_centroids)
                selected = a.centroid_top_k * a.vocab_size / a.num_centroids / tp   # a rank scores those it holds
                out.flops["drafter.head"] += 2 * rows * hidden * selected
                out.read_bytes["drafter.head_weight"] += rows * selected * hidden * self.weight_bytes
                out.write_bytes["drafter.head_output"] += rows * a.vocab_size * LOGITS_BYTES
            else:
                self._linear(out, "drafter.head", rows, hidden, a.vocab_size / tp, LOGITS_BYTES)
            self._linear(out, "drafter.post_projection", rows, hidden, backbone)

    def _drafter_comm(self, out: PerfBreakdown, a: AssistantSpec, rows: int, constrained: bool, tp: int) -> None:
        """One draft step's collectives over its `rows` (model/assistant.py, spec_decode/speculator.py)."""
        ba = self.act_bytes
        self._comm(out, "drafter_embed_all_reduce", "all_reduce", rows * a.backbone_hidden_size * ba, tp)
        per_layers = rows * a.hidden_size * ba * len(a.layer_types)
        self._comm(out, "drafter_o_proj_all_reduce", "all_reduce", per_layers, tp)
        self._comm(out, "drafter_mlp_all_reduce", "all_reduce", per_layers, tp)
        if a.use_ordered_embeddings:   # the selected rows' scores, zero where another rank holds the row
            selected = a.centroid_top_k * (a.vocab_size // a.num_centroids)
            self._comm(out, "drafter_centroid_scores_all_reduce", "all_reduce", rows * selected * ba, tp)
        else:
            self._comm(out, "drafter_logits_all_gather", "all_gather", rows * a.vocab_size * ba, tp)
        if constrained:   # rank 0's masked argmax to every rank
            self._comm(out, "drafter_token_broadcast", "broadcast", rows * TOKEN_ID_BYTES, tp)
