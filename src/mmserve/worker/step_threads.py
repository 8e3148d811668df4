"""How many torch threads each engine step runs on: the whole pool, or one core fewer, by measurement.

On a CPU the engine shares the machine's cores with the front end (video decode, gRPC,
detokenisation) and with clients on the same host. An OpenMP team as large as the machine occupies
every core at each parallel region, and when another thread takes one of them the whole team waits
at the region's barrier. A step whose time is Python, dispatch and small ops (a tiny model, a small
decode batch) runs hardly faster on the whole pool than on one core fewer, so there the last core
only slows the front end and, through it, the engine's next inputs. A step dominated by large
matmuls gains about what the extra core adds.

So the core times every step by size class (decode or prefill, with or without frames, tokens rounded
to a power of two) and runs each class on the whole pool or on one thread fewer ("narrow", the core
left to the front end), whichever measured faster; the pool must be faster by at least
`MIN_THREAD_GAIN` of one narrow thread's share (1.25x on 2 cores, 1.008x on 32), since it takes a
core the front end could use. A class is measured on the pool first; only classes whose pool steps
are short (`PROBE_BELOW_S`) try the narrow team, so a long prefill step is never slowed to find out.
Every `REPROBE_EVERY` steps a class measures again, as the load around the engine changes.

The thread count changes results only by float rounding (some CPU kernels split a reduction across
threads; tests/engine/test_step_threads.py bounds the difference), as which requests share a step
already does in a continuously batched server. The offline `LLM` keeps a fixed pool (nothing shares
its cores, and a script's reruns stay bit-reproducible).
"""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict, deque
from dataclasses import dataclass, field

from mmserve.core.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)

PROBES = 3              # steps measured per candidate before a class chooses
MIN_THREAD_GAIN = 0.25  # the pool's last thread must add a quarter of a narrow thread's work
PROBE_BELOW_S = 0.05    # classes whose pool steps take longer never try the narrow team
REPROBE_EVERY = 512     # steps of a class between two rounds of measurement

SizeClass = tuple[bool, bool, int]   # (any prefill, any frame encoded, token count's bit length)


def size_class(out: SchedulerOutput) -> SizeClass:
    prefill = any(s.is_prefill for s in out.scheduled)
    frames = any(s.frames for s in out.scheduled)
    return prefill, frames, out.num_batched_tokens.bit_length()


@dataclass
class _ClassState:
    samples: dict[int, deque] = field(default_factory=lambda: defaultdict(lambda: deque(maxlen=PROBES)))
    chosen: int | None = None
    steps_since_choice: int = 0


class StepThreads:
    """Per size class (`size_class(out)`, once per step): `threads_for(size)` before the step,
    `record(size, threads, seconds)` after it. Not adaptive (or a pool of one): every step runs on
    the whole pool. Policy only: the core sets torch's pool (`cpu_threads.torch_threads`)."""

    def __init__(self, pool_size: int, *, adaptive: bool = True):
        self.pool_size = pool_size
        self.narrow = pool_size - 1
        self.enabled = adaptive and pool_size > 1
        self._classes: dict[SizeClass, _ClassState] = defaultdict(_ClassState)

    def threads_for(self, size: SizeClass) -> int:
        if not self.enabled:
            return self.pool_size
        state = self._classes[size]
        if state.chosen is not None:
            return state.chosen
        pool = state.samples[self.pool_size]
        if len(pool) < PROBES or statistics.median(pool) >= PROBE_BELOW_S:
            return self.pool_size
        return self.narrow

    def record(self, size: SizeClass, threads: int, seconds: float) -> None:
        if not self.enabled:
            return
        state = self._classes[size]
        if state.chosen is not None:
            state.steps_since_choice += 1
            if state.steps_since_choice >= REPROBE_EVERY:
                self._classes[size] = _ClassState()
            return
        state.samples[threads].append(seconds)
        pool, narrow = state.samples[self.pool_size], state.samples[self.narrow]
        if len(pool) < PROBES:
            return
        pool_s = statistics.median(pool)
        if pool_s >= PROBE_BELOW_S:
            state.chosen = self.pool_size
        elif len(narrow) >= PROBES:
            narrow_s = statistics.median(narrow)
            state.chosen = self.pool_size if narrow_s >= pool_s * (1 + MIN_THREAD_GAIN / self.narrow) else self.narrow
            logger.debug("steps %s: %d thread(s) (median %.1f ms on %d, %.1f ms on %d)", size, state.chosen,
                         pool_s * 1e3, self.pool_size, narrow_s * 1e3, self.narrow)

    def choices(self) -> dict[SizeClass, int]:
        """The classes decided so far and their thread counts (for logs and tests)."""
        return {key: s.chosen for key, s in self._classes.items() if s.chosen is not None}
