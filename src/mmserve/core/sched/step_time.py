"""How many prompt tokens a step may carry beside decoding requests: stall-free batching (as in
Sarathi-Serve) with its limit read from the perf model instead of a profile.

A decode step streams the weights and the decoding requests' K/V; prompt tokens beside it add
their FLOPs (and a little traffic), and a chunk's frames their vision tower's. Below the device's
ridge point (FLOPs per byte) they ride almost free on the weights' reads; past it every token
lengthens the step, and with it the inter-token latency of every request that decodes. A token budget
alone cannot say where that happens: it depends on the model, the device and the batch (at 12B
dimensions on an H100 a 2048-token chunk makes the step several times a decode's; on a 0.2 M model on
a CPU it costs little). So, while any running request decodes, a step's prompt tokens stop where the
step's roofline time (the perf model's bytes over the device's bandwidth, its FLOPs over the device's
FLOP/s, the larger) would pass `max_step_slowdown` times that of its decode rows alone.

The roofline is the step's floor, not its time: the slowdown it bounds is the one a kernel-efficient
engine would see (a lease measures the real one: bench/gpu_check.py's video_prefill section). HBM
traffic and FLOPs only: tensor parallelism's collectives are not in it.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from mmserve.core.sched.chunks import frames_in_chunk, whole_lengths
from mmserve.metrics.perf_model import (
    AudioWork,
    PerfBreakdown,
    PerfModel,
    RequestWork,
    StepContext,
    VisionWork,
)
from mmserve.request import Request

Media = tuple[tuple[VisionWork, ...], tuple[AudioWork, ...]]
NO_MEDIA: Media = ((), ())
NO_RANGES: frozenset[int] = frozenset()
# The kinds of prompt chunk a step may carry; the first of each kind may pass the cap by one item
PROMPT, ADMISSION, OPEN = "a running prompt's", "an admission's", "a live session's"


class StepTimeModel:
    """A step's roofline seconds from the perf model and the device's peaks (per GPU under tensor
    parallelism)."""

    def __init__(self, perf: PerfModel, *, flops: float, bandwidth: float, slowdown: float):
        if not slowdown > 1:
            raise ValueError(f"max_step_slowdown must be above 1 (0: off), got {slowdown}")
        self.perf, self.flops, self.bandwidth, self.slowdown = perf, flops, bandwidth, slowdown
        spec = perf.spec
        self._pool = spec.vision.pool_kernel ** 2 if spec.vision is not None else 0   # patches per soft token
        self._audio = spec.audio is not None
        # The distinct experts a step's tokens reach, as the perf model counts them (min(E, tokens x k)):
        # given explicitly, so a chunk adds only the experts the step's earlier tokens left untouched.
        self._moe = next((layer.moe for layer in spec.layers if layer.moe is not None), None)
        # a chunk's cost is what it adds to a step that already decodes (the weights are read once),
        # by the row kind it decodes beside: a verify row makes KV-sharing layers run every row
        self._bases = {verify: RequestWork(1 + verify, 1 + verify, False) for verify in (False, True)}
        self._base_costs: dict[tuple[bool, float | None], tuple[float, float]] = {}   # by (verify, experts)
        # an encoder item's own bytes and FLOPs, and its tower's weights (read once a step): by the item
        self._item_costs: dict[VisionWork | AudioWork, tuple[tuple[float, float], tuple[float, float]]] = {}

    def _experts(self, tokens: int) -> float | None:
        return None if self._moe is None else min(self._moe.num_experts, tokens * self._moe.top_k)

    def _cost(self, requests: Sequence[RequestWork], experts: float | None, media: Media = NO_MEDIA) -> tuple[float, float]:
        """The perf model's bytes and FLOPs of `requests` (and encoder work), an MoE layer reaching `experts`."""
        ctx = StepContext(tuple(requests), images=media[0], audio=media[1], experts_touched=experts)
        out: PerfBreakdown = self.perf.step(ctx, per_gpu=True)
        return out.total_bytes, out.total_flops

    def seconds(self, num_bytes: float, num_flops: float) -> float:
        return max(num_bytes / self.bandwidth, num_flops / self.flops)

    def media(self, request: Request, start: int, num_tokens: int, ahead: Container[int] | None = None) -> Media:
        """The encoder work a chunk's step carries: each image or frame inside it through the vision
        tower (chunks never split one), each audio segment whose first token it holds through the
        audio tower (encoded whole then; with prefix caching off no encoder cache keeps it for a
        later chunk, which encodes it again unpriced). With encode-ahead (`ahead`: the items the
        step before encoded ahead) a step encodes the next chunk's items beside its own: an item in
        `ahead` counts once, standing for the next chunk's item of the same place, and any other
        twice (encoded in this step, and the next one's beside it)."""
        ranges, end = request.mm_ranges_np, start + num_tokens
        inside = [i for i in frames_in_chunk(ranges, start, num_tokens)
                  if (ranges[i, 0] >= start if self._is_audio(request, i) else ranges[i, 1] < end)]
        if ahead is not None:
            inside += [i for i in inside if i not in ahead]
        return self.items(request, inside)

    def num_items(self, request: Request, start: int, num_tokens: int) -> int:
        """The encoder items `media` prices for a chunk (once each)."""
        images, audio = self.media(request, start, num_tokens)
        return len(images) + len(audio)

    @staticmethod
    def _is_audio(request: Request, index: int) -> bool:
        return bool(len(request.mm_is_audio) and request.mm_is_audio[index])

    def items(self, request: Request, indices: Sequence[int]) -> Media:
        """The encoder work of these ranges of `request`: an image or frame by the patches its input
        runs (padding included), else its soft tokens x the pooling; an audio segment by 4 log-mel
        frames a soft token."""
        images, audio = [], []
        for i in indices:
            n = int(request.mm_ranges_np[i, 1] - request.mm_ranges_np[i, 0] + 1)
            if self._is_audio(request, i):
                if self._audio:
                    audio.append(AudioWork(4 * n, n))
            elif self._pool:
                patches = len(request.mm_inputs[i].pixel_values) if request.mm_inputs else n * self._pool
                images.append(VisionWork(patches, n))
        return tuple(images), tuple(audio)

    def chunk_cost(self, start: int, num_tokens: int, *, verify: bool, before: int,
                   media: Media = NO_MEDIA) -> tuple[float, float]:
        """Bytes and FLOPs a prompt chunk [start, start + num_tokens) and its encoder work add to a
        decoding step (with verify rows when `verify`) that already carries `before` tokens. Not
        sampling: a prompt's last chunk samples one row more, which it leaves out."""
        base, key = self._bases[verify], (verify, self._experts(before))
        if key not in self._base_costs:
            self._base_costs[key] = self._cost([base], key[1])
        base_bytes, base_flops = self._base_costs[key]
        chunk = RequestWork(num_tokens, start + num_tokens, True, samples=False)
        num_bytes, num_flops = self._cost([base, chunk], self._experts(before + num_tokens))
        media_bytes, media_flops = self.media_cost(media)
        return num_bytes - base_bytes + media_bytes, num_flops - base_flops + media_flops

    def media_cost(self, media: Media) -> tuple[float, float]:
        """Bytes and FLOPs of encoder work alone: the perf model's, which is each item's own plus
        each tower's weights once, from its per-item parts (cached: a video's frames are alike).
        Once per call: a step that prices several chunks' or items' encodings counts the weights
        in each (a little high: 0.02-0.2 ms an item at H200 peaks)."""
        num_bytes = num_flops = 0.0
        for items in media:
            for item in items:
                (b, f), weights = self._item_cost(item)
                num_bytes, num_flops = num_bytes + b, num_flops + f
            if items:
                num_bytes, num_flops = num_bytes + weights[0], num_flops + weights[1]
        return num_bytes, num_flops

    def _item_cost(self, item: VisionWork | AudioWork) -> tuple[tuple[float, float], tuple[float, float]]:
        if item not in self._item_costs:
            media = lambda n: ((item,) * n, ()) if isinstance(item, VisionWork) else ((), (item,) * n)   # noqa: E731
            one, two = self._cost([], None, media(1)), self._cost([], None, media(2))
            own = (two[0] - one[0], two[1] - one[1])
            self._item_costs[item] = own, (one[0] - own[0], one[1] - own[1])
        return self._item_costs[item]

    def cap(self, rows: Sequence[RequestWork]) -> PrefillCap:
        """This step's room for prompt tokens beside its decode rows (each its last token, drafts and
        pads). An MoE model's few decodes reach few experts, and the first prompt tokens beside them
        make the step read every expert's weights (any chunk of 14 tokens or more, at top 8 of 128):
        its limit prices the rows as if they reached every expert, so that a prompt moves at all
        (the strict limit held one beside 2 decodes of 26B-A4B to 2 tokens a step, and a limit of
        the all-experts step itself to one frame), at the cost of those few decodes slowing by more
        than the slowdown (modelled at 26B-A4B: 9x at 1 decode, 2.5x at 8: docs/benchmarks.md).
        From about 16 decodes the rows reach every expert themselves and nothing changes."""
        tokens = sum(r.num_tokens for r in rows)
        num_bytes, num_flops = self._cost(rows, self._experts(tokens))
        limit_s = self.slowdown * self.seconds(*(self._cost(rows, self._moe.num_experts) if self._moe else
                                                 (num_bytes, num_flops)))
        return PrefillCap(self, num_bytes, num_flops, tokens, limit_s, verify=any(r.num_tokens > 1 for r in rows))


class PrefillCap:
    """One step's prompt tokens under its limit: the decode rows' roofline times the slowdown."""

    def __init__(self, model: StepTimeModel, num_bytes: float, num_flops: float, tokens: int, limit_s: float, *,
                 verify: bool):
        self.model, self.verify, self.limit_s = model, verify, limit_s
        self.num_bytes, self.num_flops = num_bytes, num_flops   # the step so far: decode rows, chunks taken
        self.tokens = tokens   # the step's tokens so far
        self.served: set[str] = set()   # the kinds of chunk the step carries (the scheduler's names)
        self._costs: dict[tuple[str, int, int, int], tuple[float, float]] = {}   # room's evaluations, for take

    def _chunk_cost(self, request: Request, start: int, num_tokens: int, ahead: Container[int] | None) -> tuple[float, float]:
        key = (request.request_id, start, num_tokens, self.tokens)   # (one `ahead` per request in a step)
        if key not in self._costs:
            self._costs[key] = self.model.chunk_cost(start, num_tokens, verify=self.verify, before=self.tokens,
                                                     media=self.model.media(request, start, num_tokens, ahead))
        return self._costs[key]

    def _over(self, request: Request, start: int, num_tokens: int, ahead: Container[int] | None) -> float:
        """Seconds the step would pass its limit by with this chunk (<= 0: it fits)."""
        b, f = self._chunk_cost(request, start, num_tokens, ahead)
        return self.model.seconds(self.num_bytes + b, self.num_flops + f) - self.limit_s

    def room(self, request: Request, start: int, want: int, ahead: Container[int] | None = None) -> int:
        """The longest chunk of `request` from `start`, at most `want` tokens, that keeps the step
        within its limit (`ahead`: as `StepTimeModel.media` reads it), and where the prompt has
        images or frames, the longest that also ends outside them (the only lengths a chunk may take;
        the cost jumps at each, by the item's encoding). Its cost grows with its length, so the
        answer is bracketed: a binary search over those lengths, or over every length of a text
        span, where the cost is smooth, probing a guess interpolated between the bracket's ends and
        its neighbour before the bracket's middle."""
        if want <= 0:
            return 0
        lengths = whole_lengths(request.vision_ranges_np, start, want)
        if lengths is not None:
            lo, hi = -1, len(lengths)   # lengths[lo] fits (or none: -1), lengths[hi] does not (or past the end)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if self._over(request, start, int(lengths[mid]), ahead) <= 0 else (lo, mid)
            return int(lengths[lo]) if lo >= 0 else 0
        over_hi = self._over(request, start, want, ahead)
        if over_hi <= 0:
            return want
        lo, hi, over_lo = 0, want, self._over(request, start, 0, ahead)   # lo fits (0 always counts), hi does not
        while hi - lo > 1:
            guess = lo + int((hi - lo) * -over_lo / (over_hi - over_lo)) if over_hi > over_lo else lo
            for probe in (min(max(guess, lo + 1), hi - 1), (lo + hi) // 2):
                if not lo < probe < hi:
                    continue
                over = self._over(request, start, probe, ahead)
                if over <= 0:
                    lo, over_lo = probe, over
                    if probe + 1 < hi and self._over(request, start, probe + 1, ahead) > 0:
                        hi = probe + 1
                else:
                    hi, over_hi = probe, over
        return lo

    def take(self, request: Request, start: int, num_tokens: int, kind: str, ahead: Container[int] | None = None) -> None:
        """Count a chunk the step now carries."""
        b, f = self._chunk_cost(request, start, num_tokens, ahead)
        self.num_bytes += b
        self.num_flops += f
        self.tokens += num_tokens
        self.served.add(kind)

    def take_ahead(self, request: Request, indices: Sequence[int], prepaid: int) -> list[int]:
        """Of `indices` (the items the next step will likely consume, in order), those this step can
        encode ahead beside itself: the first `prepaid` (this step's own chunk paid for as many,
        `StepTimeModel.media`), then each whose encoding still fits the limit (counted); the rest
        are left to the step that consumes them."""
        kept = list(indices[:prepaid])
        for i in indices[prepaid:]:
            b, f = self.model.media_cost(self.model.items(request, [i]))
            if self.model.seconds(self.num_bytes + b, self.num_flops + f) > self.limit_s:
                break
            self.num_bytes += b
            self.num_flops += f
            kept.append(i)
        return kept
