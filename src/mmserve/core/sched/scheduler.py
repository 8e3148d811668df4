"""Continuous batching with chunked prefill that never ends a chunk inside an image or frame.

(An audio segment's soft tokens are causal, so a chunk may end inside one: the segment is encoded
whole when its first token is scheduled, and each chunk takes its rows.)

Each step spends a token budget: running requests first (decodes and unfinished prefills, in
admission order), then waiting ones (FCFS, or higher priority first), interleaved between clients
(core/sched/fair_share.py: one client's queue of 200 does not hold another's first request back). The budget is
max_num_batched_tokens, or the larger prefill_batched_tokens while no running request decodes.
A waiting request starts after the longest prefix the KV cache already holds; one whose next block
a running request is computing right now waits for it (the budget goes to the next in line)
instead of computing it a second time.
When KV blocks run out, the request that would be served last (lowest priority, then the client
with the most running, its last) is preempted: its blocks are freed and it is recomputed later.
Parallel samples (`n > 1`): samples i > 0 are held (core/forks.py) until sample 0 has computed the
prompt, then join the running batch on its K/V; a running sample 0 keeps a seat free for each.
Speculative decoding: a decoding request with drafts (`Request.draft_token_ids`) is scheduled as a
verify chunk of 1 + K tokens when the budget and KV allow, else with fewer drafts or none (plain
decode); `update` rolls `num_computed_tokens` back past the drafts its step rejected, so only
verified tokens are ever cached. With `verify_width` (1 + K, when the runner has graphs for verify
steps) a speculating request with fewer than K drafts (near max_tokens, cut by its grammar) is
padded to that width with pad positions, which the step never samples and always rolls back, so a
speculating batch stays uniform and replays one graph; pads go first when the budget, KV or the
context length is short.
Async scheduling (`async_scheduling`): the next step is scheduled while this one runs, before its
tokens reach the host. Each chunk advances `num_computed_tokens` when it is scheduled, and a chunk
that samples adds a placeholder (`Request.num_output_placeholders`) per row it may keep (a verify
chunk: all of them, as if every draft were accepted) that counts as the request's next tokens: the
next step decodes the last, its id (and, with speculation, the drafts made after it: `DEVICE_DRAFT`
entries) taken on the device, and the runner moves its positions back there by the rows the
device's acceptance rejected. A request with all of its max_tokens in flight is not scheduled
again; one with a placeholder waits off the waiting queue until its tokens land. `update` then
rolls back the rejected rows and keys the filled blocks.
Open prompts (a live session's context, `Request.open_prompt`) grow while they run; their chunks
come last in a step, after waiting requests, and never sample.
Encode-ahead (`encode_ahead`): each step's output also names the frames and audio segments the
next step will likely consume (`_lookahead`: each running prompt's next chunk under the next
step's budget), so the runner encodes them while this step runs. It is a guess, exact unless
admissions, preemptions or drafts change the next step's budget: a frame guessed wrongly is
encoded a step or more early and held until its request consumes it.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter

from mmserve.config import SCHEDULING_POLICY_CHOICES
from mmserve.core.forks import HeldForks, prompt_done
from mmserve.core.kv_cache.manager import KVCacheManager
from mmserve.core.kv_cache.planner import window_pool_blocks
from mmserve.core.sched.chunks import align_chunk, frames_in_chunk, smallest_chunk
from mmserve.core.sched.fair_share import interleave
from mmserve.core.sched.output import DEVICE_DRAFT, ScheduledRequest, SchedulerOutput
from mmserve.core.sched.step_time import ADMISSION, NO_RANGES, OPEN, PROMPT, PrefillCap, StepTimeModel
from mmserve.errors import InvalidInputError, LimitExceededError
from mmserve.metrics.perf_model import RequestWork
from mmserve.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        prefill_batched_tokens: int = 0,
        max_model_len: int,
        policy: str = "fcfs",
        verify_width: int = 0,
        async_scheduling: bool = False,
        encode_ahead: bool = False,
        step_time: StepTimeModel | None = None,
    ):
        if policy not in SCHEDULING_POLICY_CHOICES:
            raise ValueError(f"--scheduling-policy {policy!r}: choose from {', '.join(SCHEDULING_POLICY_CHOICES)}")
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_batched_tokens = max(prefill_batched_tokens, max_num_batched_tokens)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.policy = policy
        self.verify_width = verify_width   # 1 + K: the rows a speculating request's chunk is padded to; 0 = none
        self.async_scheduling = async_scheduling
        self.encode_ahead = encode_ahead
        self.step_time = step_time   # caps prefill beside decodes (max_step_slowdown); None: token budgets only
        self._cap: PrefillCap | None = None   # this step's, once a prompt chunk asks (_step_cap)
        self._cap_made = False
        self._step_scheduled: dict[str, ScheduledRequest] = {}   # this step's, while it is scheduled
        self._ahead: dict[str, frozenset[int]] = {}   # the ranges the last step named to encode ahead
        self.waiting: list[Request] = []     # sorted by _order_key; admitted in _admission_order
        self.running: list[Request] = []     # admission order
        self._by_id: dict[str, Request] = {}
        self._finished_since_step: list[str] = []
        self._frame_blocked: set[str] = set()
        self.forks = HeldForks()             # parallel samples waiting for their parent's prompt

    # -- admission -----------------------------------------------------------------------------------------

    def _order_key(self, r: Request) -> tuple:
        """Sort key of the waiting queue: smallest is served first (higher priority, then earlier)."""
        return (-r.priority, r.arrival_time) if self.policy == "priority" else (r.arrival_time,)

    def check_admissible(self, request: Request) -> None:
        """Raise (before any work starts) if the request can never run with this configuration."""
        n = request.num_prompt_tokens
        if n == 0:
            raise InvalidInputError("prompt", "the prompt is empty")
        ranges = request.mm_ranges_np
        if len(ranges):
            if (ranges[:, 0] > ranges[:, 1]).any() or ranges[0, 0] < 0 or ranges[-1, 1] >= n:
                raise InvalidInputError("mm_ranges", "a range is empty or lies outside the prompt")
            if (ranges[1:, 0] <= ranges[:-1, 1]).any():
                raise InvalidInputError("mm_ranges", "ranges must be sorted and disjoint")
        whole = request.vision_ranges_np   # the ranges a chunk never splits
        if len(whole):
            longest = int((whole[:, 1] - whole[:, 0] + 1).max())
            if longest > self.max_num_batched_tokens:
                raise LimitExceededError(
                    f"an image/frame of {longest} tokens cannot fit one step's budget of "
                    f"{self.max_num_batched_tokens} tokens", "--max-num-batched-tokens")
        total = n + request.sampling_params.max_tokens
        if total > self.max_model_len:
            raise LimitExceededError(
                f"prompt ({n}) + max_tokens ({request.sampling_params.max_tokens}) = {total} tokens exceeds "
                f"the context length {self.max_model_len}", "--max-model-len")
        for t, blocks in self.kv.max_blocks_needed(total, self.prefill_batched_tokens).items():
            usable = self.kv.pools[t].num_usable
            if blocks > usable:
                raise LimitExceededError(
                    f"{total} tokens need {blocks} KV blocks in pool {t} but it has {usable}",
                    "--kv-cache-bytes or --num-kv-blocks")
        if request.sampling_params.n > 1 and request.fork_of is None:
            self._check_samples_fit(request)

    def _check_samples_fit(self, request: Request) -> None:
        """Refuse (it can never fit) n samples of prompt + max_tokens that need more KV blocks than a
        pool has: in a full-attention pool a sample shares its parent's whole blocks before the
        prompt's last token (a prompt of whole blocks: all but the last, which each sample copies)
        and holds the rest itself; a windowed pool holds n windows and one step's tokens between
        them (the planner's bound, planner.window_pool_blocks). Speculation's K counts only for the
        pads (`verify_width`) that fill a sample's last verify chunks up to K - 1 positions past its
        end: one request drops them when a pool is short (`KVCacheManager.max_blocks_needed`), but
        a sample's pads take, while it is free, a block its sibling still needs, which then preempts
        the sibling."""
        n, prompt_len, max_tokens = request.sampling_params.n, request.num_prompt_tokens, request.sampling_params.max_tokens
        pads_past_end = max(0, self.verify_width - 2)
        one = self.kv.max_blocks_needed(prompt_len + max_tokens + pads_past_end, self.prefill_batched_tokens)
        shared = self.kv.sample_shared_tokens(request) // self.kv.block_size
        for pool, blocks in one.items():
            window = self.kv.plans[pool].window
            if window is None:
                need = blocks + (n - 1) * (blocks - shared)
            else:
                need = min(n * blocks, window_pool_blocks(window, block_size=self.kv.block_size, max_num_seqs=n,
                                                          max_step_tokens=self.prefill_batched_tokens) - 1)
            usable = self.kv.pools[pool].num_usable
            if need > usable:
                pads = f" (+ {pads_past_end} speculative pad positions)" if pads_past_end else ""
                raise InvalidInputError(
                    "sampling.n", f"{n} samples of {prompt_len} prompt + {max_tokens} max_tokens tokens{pads} need {need} "
                    f"KV blocks in pool {pool} but it has {usable}: lower n or max_tokens (or raise --kv-cache-bytes)")

    def enqueue(self, request: Request) -> None:
        """Queue an already admitted request (the engine checks admission on the caller's thread); a
        parallel sample whose parent is here is held until the parent's prompt is computed, or joins
        it at once if it is."""
        request.status = RequestStatus.WAITING
        self._by_id[request.request_id] = request
        parent = self._by_id.get(request.fork_of) if request.fork_of else None
        if parent is not None and not prompt_done(parent):
            self.forks.hold(request)
        elif parent is None or not self._join(request, parent):
            bisect.insort(self.waiting, request, key=self._order_key)

    def _join(self, fork: Request, parent: Request) -> bool:
        """Run a parallel sample from now on, on its running parent's K/V of the prompt (the last
        token its own); False if there is no seat, or the parent no longer holds that K/V."""
        if parent.status != RequestStatus.RUNNING or len(self.running) >= self.max_num_seqs:
            return False
        hit = self.kv.share_prefix(parent, fork)
        if not hit.num_tokens or not self.kv.allocate(fork, 0, hit):
            return False
        fork.num_computed_tokens = hit.num_tokens
        fork.num_cached_tokens = hit.num_tokens if self.kv.enable_prefix_caching else 0
        fork.status = RequestStatus.RUNNING
        self.running.append(fork)
        return True

    def _release_forks(self, parent: Request) -> None:
        """The samples held for `parent` (its prompt computed, or it ended): each joins it, or queues."""
        for fork in self.forks.release(parent.request_id):
            if not self._join(fork, parent):
                bisect.insort(self.waiting, fork, key=self._order_key)

    def finish(self, request_id: str) -> Request | None:
        """Remove a request (finished or aborted) and free its blocks. None if it is not here."""
        request = self._by_id.pop(request_id, None)
        if request is None:
            return None
        request.status = RequestStatus.FINISHED
        if self.forks.discard(request):   # it never ran
            return request
        self._release_forks(request)   # samples still waiting for its prompt compute it themselves
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request_id)
        self._finished_since_step.append(request_id)
        return request

    def _chunk(self, request: Request, budget: int) -> tuple[int, int]:
        """Tokens of the request's next chunk, and the pad positions that fill a verify chunk to
        `verify_width` rows (when the budget and context length allow the whole width)."""
        start = request.num_computed_tokens
        total = request.num_tokens + request.num_output_placeholders
        n = min(total - start, budget)
        if start >= request.num_prompt_tokens:   # decoding: every range lies in the prompt, behind it
            if total - start > 1 and not request.draft_token_ids:   # outputs recomputed after a preemption
                return self._prompt_chunk(request, start, n, self._step_cap(), PROMPT), 0   # (no media)
            if n == 1 and request.draft_token_ids:   # a verify chunk, with the drafts the budget allows
                room = budget
                if request.draft_token_ids[0] == DEVICE_DRAFT:   # made before the host knew what the request may
                    # still emit (the speculator caps the others): within max_tokens and the context
                    left = request.sampling_params.max_tokens - len(request.output_token_ids)
                    room = min(room, left - request.num_output_placeholders, self.max_model_len - start)
                del request.draft_token_ids[max(0, room - 1):]
                n += len(request.draft_token_ids)
            pads = self.verify_width - n
            if pads <= 0:   # no verify width (no speculation), or the drafts fill it
                return n, 0
            fits = n + pads <= budget and start + n + pads <= self.max_model_len
            decode = total - start == 1   # not an output token recomputed after preemption
            if fits and decode and not request.sampling_params.disable_speculation:
                return n, pads
            return n, 0
        request.draft_token_ids.clear()
        return self._prompt_chunk(request, start, n, self._step_cap(), OPEN if request.open_prompt else PROMPT,
                                  self._encoded_ahead(request)), 0

    @staticmethod
    def _prompt_chunk(request: Request, start: int, want: int, cap: PrefillCap | None, kind: str,
                      ahead: frozenset[int] | None = None) -> int:
        """A prompt chunk's length: `want` tokens at most, never ending inside an image or frame, and
        under the step's prefill cap when it has one (`ahead`: as `StepTimeModel.media` reads it).
        The first chunk of each kind in a step (a running prompt's, an admission's, a live
        session's) may pass the cap by the one whole frame (or token) its prompt needs to move at
        all, so no kind waits on another's long prompt."""
        ranges = request.vision_ranges_np
        if cap is None:
            return align_chunk(ranges, start, want)
        n = align_chunk(ranges, start, cap.room(request, start, want, ahead))
        if n == 0 and kind not in cap.served and want > 0:
            n = align_chunk(ranges, start, min(want, smallest_chunk(ranges, start)))
        return n

    def _new_cap(self, scheduled: dict[str, ScheduledRequest]) -> PrefillCap | None:
        """A step's prefill cap, while any running request decodes: its decode rows as `scheduled`
        has them, or else as they will likely be (the last token and drafts, padded to the verify
        width; none for a request whose every token is in flight)."""
        if self.step_time is None:
            return None
        rows = []
        for r in self.running:
            if r.is_prefill:
                continue
            s = scheduled.get(r.request_id)
            if s is not None:
                rows.append(RequestWork(s.num_tokens, s.seq_len, False))
            elif r.status == RequestStatus.RUNNING and not self._all_in_flight(r):
                width = 1 + len(r.draft_token_ids)
                if width < self.verify_width and not r.sampling_params.disable_speculation:
                    width = self.verify_width
                rows.append(RequestWork(width, r.num_computed_tokens + width, False))
        return self.step_time.cap(rows) if rows else None

    def _step_cap(self) -> PrefillCap | None:
        """This step's cap, made when its first prompt chunk is sized (a decode-only step makes none)."""
        if not self._cap_made:
            self._cap, self._cap_made = self._new_cap(self._step_scheduled), True
        return self._cap

    def _took(self, s: ScheduledRequest, kind: str) -> None:
        """Count a prompt chunk just scheduled against the step's cap."""
        if self._cap is not None and s.is_prefill:
            self._cap.take(s.request, s.num_computed_tokens, s.num_tokens, kind, self._encoded_ahead(s.request))

    def _encoded_ahead(self, request: Request) -> frozenset[int] | None:
        """The request's items the last step named to encode ahead; None without encode-ahead."""
        return self._ahead.get(request.request_id, NO_RANGES) if self.encode_ahead else None

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.draft_token_ids.clear()
        victim.status = RequestStatus.PREEMPTED
        bisect.insort(self.waiting, victim, key=self._order_key)
        logger.debug("preempted %s (KV blocks exhausted: refusals by pool %s)", victim.request_id, dict(self.kv.refusals))

    def _admission_order(self) -> list[Request]:
        """The waiting queue as it is admitted: each client's requests in queue order, clients
        taking turns by how many requests each already runs."""
        return interleave(self.waiting, Counter(r.owner for r in self.running), by_priority=self.policy == "priority")

    def _pick_victim(self) -> Request:
        """The running request that would be served last: lowest priority, then the client with the
        most running, its latest (FCFS: last admitted; priority: latest arrival)."""
        by_priority = self.policy == "priority"
        served = sorted(self.running, key=self._order_key) if by_priority else self.running
        return interleave(served, by_priority=by_priority)[-1]

    def token_budget(self) -> int:
        """The larger prefill budget while no running request decodes: a longer step then delays
        nobody's next token. Once one decodes, steps shrink back so its TPOT stays bounded."""
        if self.prefill_batched_tokens == self.max_num_batched_tokens or any(
                not r.is_prefill for r in self.running):
            return self.max_num_batched_tokens
        return self.prefill_batched_tokens

    def schedule(self) -> SchedulerOutput:
        budget = self.token_budget()
        self._cap, self._cap_made = None, self.step_time is None
        scheduled: dict[str, ScheduledRequest] = {}
        self._step_scheduled = scheduled
        preempted: list[str] = []
        self.kv.release_out_of_window(self.running)   # one this step leaves out holds its window, not its last chunk

        # A request whose next frame did not fit last step's leftover budget goes first now, so a
        # steady stream of decodes can never starve it. Open prompts (live sessions' frames) go after
        # every other request, waiting ones included: a frame waits a step, a question's token does not.
        blocked, self._frame_blocked = self._frame_blocked, set()
        order = sorted(self.running, key=lambda r: r.request_id not in blocked) if blocked else list(self.running)
        for request in order:
            if not request.open_prompt:
                budget = self._schedule_running(request, budget, scheduled, preempted)

        # a seat for every sample held for a running parent: it joins the batch once the prompt is computed
        seats = len(self.running) + (sum(len(self.forks.of(r.request_id)) for r in self.running) if len(self.forks) else 0)
        admission = self._admission_order() if self.waiting and not preempted else []   # none after a preemption
        for request in admission:
            if budget <= 0 or seats >= self.max_num_seqs:
                break
            if request.num_output_placeholders:   # preempted with a token on its way: recompute once it lands
                continue
            needs = 1 + len(self.forks.of(request.request_id))
            if seats + needs > self.max_num_seqs and seats:   # (more samples than seats: alone, and the rest queue)
                break
            hit = self.kv.find_cached_prefix(request)   # the chunk starts after the reused prefix
            if hit.next_in_flight:   # a running request is computing this prefix: reuse it next step
                continue
            start = hit.num_tokens
            n = self._prompt_chunk(request, start, min(request.num_tokens - start, budget), self._step_cap(), ADMISSION,
                                   self._encoded_ahead(request))
            if n == 0 or not self.kv.allocate(request, n, hit):
                break
            self.waiting.remove(request)
            first = request.status == RequestStatus.WAITING   # not a preempted request's return
            if first:
                request.num_cached_tokens = min(start, request.num_prompt_tokens)
            request.num_computed_tokens = start
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            seats += needs
            scheduled[request.request_id] = self._scheduled(request, n)
            self._took(scheduled[request.request_id], ADMISSION)
            if first and self.kv.enable_prefix_caching:   # a return's lookup is not a query (as in vLLM)
                scheduled[request.request_id].num_cached_tokens = start
            budget -= n

        for request in order:
            if request.open_prompt and request.num_computed_tokens < request.num_tokens:
                budget = self._schedule_running(request, budget, scheduled, preempted)

        ahead = self._lookahead(scheduled) if self.encode_ahead else []   # (under this step's cap too)
        self._ahead = {r.request_id: frozenset(frames) for r, frames in ahead} if self.step_time is not None else {}
        self._cap, self._cap_made, self._step_scheduled = None, True, {}
        finished, self._finished_since_step = self._finished_since_step, []
        if self.async_scheduling:   # the step's computed tokens, and a placeholder per row a sampling chunk may keep
            for s in scheduled.values():   # (ScheduledRequest.seq_len, Request.num_tokens, num_sampled_rows inlined)
                r, seq_len = s.request, s.num_computed_tokens + s.num_tokens
                placeholders = r.num_output_placeholders
                if seq_len >= len(r.prompt_token_ids) + len(r.output_token_ids) + placeholders and not r.open_prompt:
                    r.num_output_placeholders = placeholders + 1 + len(s.draft_token_ids) + s.num_pad_drafts
                r.num_computed_tokens = seq_len
        copies = self.kv.take_block_copies() if scheduled else {}   # made before the step's forward
        return SchedulerOutput(list(scheduled.values()), preempted_ids=preempted, finished_ids=finished,
                               block_copies=copies, encode_ahead=ahead)

    def _lookahead(self, scheduled: dict[str, ScheduledRequest]) -> list[tuple[Request, list[int]]]:
        """The media ranges the next step will consume if nothing changes: the running requests in
        the next step's order (a blocked frame first), each decode taking this step's tokens again
        and each prompt its next chunk after this step's (aligned as `_chunk` aligns it) from the
        next step's budget; (request, range indices) for the chunks that hold any. Waiting requests
        are left out: where their first chunk starts depends on the prefix cache at admission."""
        for r in self.running:   # (a loop, not any() over a generator: it runs every step)
            if r.num_computed_tokens < len(r.prompt_token_ids) and len(r.mm_ranges_np):
                break
        else:
            return []   # the usual step: nobody's prompt has media left (no sort, no budget walk)
        budget = self.token_budget()
        cap = self._new_cap(scheduled)   # the next step's, as if its decode rows were this step's
        now = self._step_cap()   # this step's: the items named here are encoded beside it
        ahead = []
        for request in sorted(self.running, key=lambda r: r.request_id not in self._frame_blocked):
            if budget <= 0:
                break
            if request.open_prompt:   # their chunks come last and grow with the session: not guessed
                continue
            s = scheduled.get(request.request_id)
            start = s.seq_len if s is not None else request.num_computed_tokens
            if start >= request.num_prompt_tokens:   # decoding: one token, or a verify chunk as this step's
                budget -= s.num_tokens if s is not None and not s.is_prefill else 1
                continue
            # the next chunk, its items encoded ahead (priced once there: `StepTimeModel.media`) as far as
            # this step paid for them with its own chunk's or can still carry them
            n = self._prompt_chunk(request, start, min(request.num_prompt_tokens - start, budget), cap, PROMPT)
            frames = frames_in_chunk(request.mm_ranges_np, start, n) if n else []
            if frames and now is not None:
                paid = now.model.num_items(request, s.num_computed_tokens, s.num_tokens) if s is not None and s.is_prefill else 0
                frames = now.take_ahead(request, frames, prepaid=paid)
            if frames:
                ahead.append((request, frames))
            if n and cap is not None:
                cap.take(request, start, n, PROMPT)
            budget -= n
        return ahead

    def _all_in_flight(self, request: Request) -> bool:
        """Async: every token the request may still make (max_tokens) is sampled by a step in flight."""
        placeholders = request.num_output_placeholders
        return placeholders > 0 and len(request.output_token_ids) + placeholders >= request.sampling_params.max_tokens

    def _schedule_running(self, request: Request, budget: int, scheduled: dict[str, ScheduledRequest],
                          preempted: list[str]) -> int:
        """Schedule a running request's next chunk (and the pads that fill a verify chunk's width),
        preempting others when KV blocks run out; returns the budget left."""
        if request.status != RequestStatus.RUNNING or budget == 0 or self._all_in_flight(request):
            return budget   # preempted earlier in this step, or every token it may still make is on its way
        n, pads = self._chunk(request, budget)
        if n == 0:
            self._frame_blocked.add(request.request_id)
            return budget
        while not self.kv.allocate(request, n + pads):
            if pads:   # short of KV: no pads, then no drafts, rather than preempt anyone
                pads = 0
                continue
            if request.draft_token_ids:
                n -= len(request.draft_token_ids)
                request.draft_token_ids.clear()
                continue
            victim = self._pick_victim()
            if victim.request_id in scheduled:
                budget += scheduled.pop(victim.request_id).num_tokens
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                break
        if request.status != RequestStatus.RUNNING:
            return budget
        scheduled[request.request_id] = self._scheduled(request, n, pads)
        self._took(scheduled[request.request_id], OPEN if request.open_prompt else PROMPT)
        return budget - n - pads

    def _scheduled(self, request: Request, n: int, pads: int = 0) -> ScheduledRequest:
        start = request.num_computed_tokens
        frames = [] if start >= request.num_prompt_tokens else frames_in_chunk(request.mm_ranges_np, start, n)
        drafts, request.draft_token_ids = request.draft_token_ids, []   # consumed by this step
        # positional (its field order; num_cached_tokens, last, set by the caller), one per request per step
        return ScheduledRequest(request, n + pads, start, request.is_prefill, frames,
                                self.kv.take_block_updates(request.request_id), drafts, pads)

    def update(self, output: SchedulerOutput, rejected: dict[str, int] | None = None) -> None:
        """Advance each scheduled request past the tokens the step just computed, less the `rejected`
        draft and pad positions at its chunk's end (their K/V is overwritten later), and offer the blocks it
        filled to the prefix cache (only now is their K/V written). With speculation the engine
        appends a step's accepted tokens before this, so the keys name verified tokens only."""
        forks = self.forks
        for s in output.scheduled:
            if s.request.status == RequestStatus.RUNNING:
                back = rejected.get(s.request.request_id, 0) if rejected else 0
                if self.async_scheduling:   # advanced when scheduled; the next step may have advanced it since
                    s.request.num_computed_tokens -= back
                else:
                    s.request.num_computed_tokens = s.seq_len - back
                self.kv.cache_blocks(s.request)
                if forks and prompt_done(s.request) and forks.of(s.request.request_id):
                    self._release_forks(s.request)
