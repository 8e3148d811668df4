"""How many prefill tokens a step may carry beside decoding requests: stall-free batching (as in
Sarathi-Serve) with its limit read from the perf model instead of a profile.

A decode step streams the weights and the decoding requests' K/V; prefill tokens beside it add
their FLOPs (and a little traffic). Below the device's ridge point (FLOPs per byte) they ride almost
free on the weights' reads; past it every token lengthens the step, and with it the inter-token
latency of every request that decodes. A token budget alone cannot say where that happens: it depends
on the model, the device and the batch (at 12B dimensions on an H100 a 2048-token chunk makes the
step several times a decode's; on a 0.2 M model on a CPU it costs little). So, while any running
request decodes, a step's prefill tokens stop where the step's roofline time (the perf model's bytes
over the device's bandwidth, its FLOPs over the device's FLOP/s, the larger) would pass
`max_step_slowdown` times that of its decode rows alone.

The roofline is the step's floor, not its time: the slowdown it bounds is the one a kernel-efficient
engine would see (a lease measures the real one: bench/gpu_check.py's video_prefill section).
"""

from __future__ import annotations

from collections.abc import Sequence

from mmserve.metrics.perf_model import PerfBreakdown, PerfModel, RequestWork, StepContext
from mmserve.request import Request


class StepTimeModel:
    """A step's roofline seconds from the perf model and the device's peaks (per GPU under tensor
    parallelism; collectives are not in it)."""

    def __init__(self, perf: PerfModel, *, flops: float, bandwidth: float, slowdown: float):
        if slowdown <= 1:
            raise ValueError(f"max_step_slowdown must be above 1 (0: off), got {slowdown}")
        self.perf, self.flops, self.bandwidth, self.slowdown = perf, flops, bandwidth, slowdown
        # The distinct experts a step's tokens reach, as the perf model counts them (min(E, tokens x k)):
        # given explicitly, so a chunk adds only the experts the step's earlier tokens left untouched.
        self._moe = next((layer.moe for layer in perf.spec.layers if layer.moe is not None), None)
        # a chunk's cost is what it adds to a step that already decodes (the weights are read once),
        # by the row kind it decodes beside: a verify row makes KV-sharing layers run every row
        self._bases = {verify: RequestWork(1 + verify, 1 + verify, False) for verify in (False, True)}
        self._base_costs: dict[tuple[bool, float | None], tuple[float, float]] = {}   # by (verify, experts)

    def _experts(self, tokens: int) -> float | None:
        return None if self._moe is None else min(self._moe.num_experts, tokens * self._moe.top_k)

    def _cost(self, requests: Sequence[RequestWork], tokens: int) -> tuple[float, float]:
        """The perf model's bytes and FLOPs of `requests`, with the experts `tokens` tokens reach."""
        out: PerfBreakdown = self.perf.step(StepContext(tuple(requests), experts_touched=self._experts(tokens)),
                                            per_gpu=True)
        return out.total_bytes, out.total_flops

    def seconds(self, num_bytes: float, num_flops: float) -> float:
        return max(num_bytes / self.bandwidth, num_flops / self.flops)

    def chunk_cost(self, start: int, num_tokens: int, *, verify: bool, before: int) -> tuple[float, float]:
        """Bytes and FLOPs a prefill chunk [start, start + num_tokens) adds to a decoding step (with
        verify rows when `verify`) that already carries `before` tokens. Not sampling: a prompt's
        last chunk samples one row more, which it leaves out."""
        base, key = self._bases[verify], (verify, self._experts(before))
        if key not in self._base_costs:
            self._base_costs[key] = self._cost([base], before)
        base_bytes, base_flops = self._base_costs[key]
        chunk = RequestWork(num_tokens, start + num_tokens, True, samples=False)
        num_bytes, num_flops = self._cost([base, chunk], before + num_tokens)
        return num_bytes - base_bytes, num_flops - base_flops

    def cap(self, decoding: Sequence[Request]) -> PrefillCap:
        """This step's room for prefill tokens beside `decoding` (running requests past their prompt),
        each with the rows the step gives it (its last token and its drafts)."""
        rows = [RequestWork(1 + len(r.draft_token_ids), r.num_computed_tokens + 1 + len(r.draft_token_ids), False)
                for r in decoding]
        tokens = sum(r.num_tokens for r in rows)
        num_bytes, num_flops = self._cost(rows, tokens)
        return PrefillCap(self, num_bytes, num_flops, tokens, verify=any(r.num_tokens > 1 for r in rows))


class PrefillCap:
    """One step's prefill tokens under its limit: the decode rows' roofline times the slowdown."""

    def __init__(self, model: StepTimeModel, num_bytes: float, num_flops: float, tokens: int, *, verify: bool):
        self.model, self.verify = model, verify
        self.limit_s = model.slowdown * model.seconds(num_bytes, num_flops)
        self.num_bytes, self.num_flops = num_bytes, num_flops   # the step so far: decode rows, chunks taken
        self.tokens = tokens   # the step's tokens so far
        self.taken = 0         # of them, prefill tokens
        self._costs: dict[tuple[int, int, int], tuple[float, float]] = {}   # room's evaluations, for take

    def _chunk_cost(self, start: int, num_tokens: int) -> tuple[float, float]:
        key = (start, num_tokens, self.tokens)
        if key not in self._costs:
            self._costs[key] = self.model.chunk_cost(start, num_tokens, verify=self.verify, before=self.tokens)
        return self._costs[key]

    def _over(self, start: int, num_tokens: int) -> float:
        """Seconds the step would pass its limit by with this chunk (<= 0: it fits)."""
        b, f = self._chunk_cost(start, num_tokens)
        return self.model.seconds(self.num_bytes + b, self.num_flops + f) - self.limit_s

    def room(self, start: int, want: int) -> int:
        """The longest chunk from `start`, at most `want` tokens, that keeps the step within its limit.
        Its cost grows with its length, so the answer is bracketed; each probe is a guess
        interpolated between the bracket's ends (the cost is near linear in the tokens) and its
        neighbour, then a halving while the bracket is still wide (at most twice a binary search's)."""
        if want <= 0:
            return 0
        over_hi = self._over(start, want)
        if over_hi <= 0:
            return want
        lo, hi, over_lo = 0, want, self._over(start, 0)   # lo fits (0 always counts as fitting), hi does not
        while hi - lo > 1:
            guess = lo + int((hi - lo) * -over_lo / (over_hi - over_lo)) if over_hi > over_lo else lo
            for probe in (min(max(guess, lo + 1), hi - 1), (lo + hi) // 2):
                if not lo < probe < hi:
                    continue
                over = self._over(start, probe)
                if over <= 0:
                    lo, over_lo = probe, over
                    if probe + 1 < hi and self._over(start, probe + 1) > 0:
                        hi = probe + 1
                else:
                    hi, over_hi = probe, over
        return lo

    def take(self, start: int, num_tokens: int) -> None:
        """Count a chunk the step now carries."""
        b, f = self._chunk_cost(start, num_tokens)
        self.num_bytes += b
        self.num_flops += f
        self.tokens += num_tokens
        self.taken += num_tokens

