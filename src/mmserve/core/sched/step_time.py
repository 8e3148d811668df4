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

from collections.abc import Sequence

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

    def _experts(self, tokens: int) -> float | None:
        return None if self._moe is None else min(self._moe.num_experts, tokens * self._moe.top_k)

    def _cost(self, requests: Sequence[RequestWork], experts: float | None, media: Media = NO_MEDIA) -> tuple[float, float]:
        """The perf model's bytes and FLOPs of `requests` (and encoder work), an MoE layer reaching `experts`."""
        ctx = StepContext(tuple(requests), images=media[0], audio=media[1], experts_touched=experts)
        out: PerfBreakdown = self.perf.step(ctx, per_gpu=True)
        return out.total_bytes, out.total_flops

    def seconds(self, num_bytes: float, num_flops: float) -> float:
        return max(num_bytes / self.bandwidth, num_flops / self.flops)

    def media(self, request: Request, start: int, num_tokens: int) -> Media:
        """The encoder work a chunk brings: each image or frame inside it through the vision tower
        (chunks never split one; its patches as its soft tokens x the pooling), each audio segment
        whose first token it holds through the audio tower (encoded whole then)."""
        end = start + num_tokens
        images: tuple[VisionWork, ...] = ()
        audio: tuple[AudioWork, ...] = ()
        v = request.vision_ranges_np
        if self._pool and len(v):
            inside = v[(v[:, 0] >= start) & (v[:, 1] < end)]
            images = tuple(VisionWork(int(n) * self._pool, int(n)) for n in inside[:, 1] - inside[:, 0] + 1)
        a = request.audio_ranges_np
        if self._audio and len(a):
            first = a[(a[:, 0] >= start) & (a[:, 0] < end)]
            audio = tuple(AudioWork(4 * int(n), int(n)) for n in first[:, 1] - first[:, 0] + 1)   # 4 frames a token
        return images, audio

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
        num_bytes, num_flops = self._cost([base, chunk], self._experts(before + num_tokens), media)
        return num_bytes - base_bytes, num_flops - base_flops

    def cap(self, rows: Sequence[RequestWork]) -> PrefillCap:
        """This step's room for prompt tokens beside its decode rows (each its last token, drafts and
        pads). An MoE model's limit prices the rows as if they reached every expert: a few decodes
        reach few, and the first prompt tokens beside them make the step read every expert's
        weights, a step no chunk worth taking avoids (without this a prompt beside 2 decodes of
        26B-A4B moved 2 tokens a step); from about 16 decodes on (top 8 of 128) the rows reach them all."""
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

    def _chunk_cost(self, request: Request, start: int, num_tokens: int) -> tuple[float, float]:
        key = (request.request_id, start, num_tokens, self.tokens)
        if key not in self._costs:
            self._costs[key] = self.model.chunk_cost(start, num_tokens, verify=self.verify, before=self.tokens,
                                                     media=self.model.media(request, start, num_tokens))
        return self._costs[key]

    def _over(self, request: Request, start: int, num_tokens: int) -> float:
        """Seconds the step would pass its limit by with this chunk (<= 0: it fits)."""
        b, f = self._chunk_cost(request, start, num_tokens)
        return self.model.seconds(self.num_bytes + b, self.num_flops + f) - self.limit_s

    def room(self, request: Request, start: int, want: int) -> int:
        """The longest chunk of `request` from `start`, at most `want` tokens, that keeps the step
        within its limit. Its cost grows with its length, so the answer is bracketed; each round
        probes a guess interpolated between the bracket's ends (the cost is near linear in the
        tokens) and its neighbour, then the bracket's middle."""
        if want <= 0:
            return 0
        over_hi = self._over(request, start, want)
        if over_hi <= 0:
            return want
        lo, hi, over_lo = 0, want, self._over(request, start, 0)   # lo fits (0 always counts), hi does not
        while hi - lo > 1:
            guess = lo + int((hi - lo) * -over_lo / (over_hi - over_lo)) if over_hi > over_lo else lo
            for probe in (min(max(guess, lo + 1), hi - 1), (lo + hi) // 2):
                if not lo < probe < hi:
                    continue
                over = self._over(request, start, probe)
                if over <= 0:
                    lo, over_lo = probe, over
                    if probe + 1 < hi and self._over(request, start, probe + 1) > 0:
                        hi = probe + 1
                else:
                    hi, over_hi = probe, over
        return lo

    def take(self, request: Request, start: int, num_tokens: int, kind: str) -> None:
        """Count a chunk the step now carries."""
        b, f = self._chunk_cost(request, start, num_tokens)
        self.num_bytes += b
        self.num_flops += f
        self.tokens += num_tokens
        self.served.add(kind)
