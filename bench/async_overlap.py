"""Async scheduling hides the host's work per step behind the device's: the engine over a simulated device.

    python bench/async_overlap.py            # JSON to bench/results/async_overlap.json
    python bench/async_overlap.py --smoke    # 1 and 16 requests, few steps; JSON to a temp file
    python bench/async_overlap.py --video    # only the video cases (below)
    python bench/async_overlap.py --tp 2     # only the tensor-parallel cases (below)
    python bench/async_overlap.py --profile  # where the async loop's host time goes at 64 requests (below)

The real EngineCore (scheduler, KV manager, step inputs and attention metadata, sampler, acceptance,
speculation's drafting loop and the device-side acceptance, outputs, step records) over the
embedded demo model (and its trained assistant, K = 3, for the speculation rows), with the device
simulated: the model's forward queues a job of `--device-ms` on a simulated stream (a timeline:
each job starts when the one before it ends) and returns at once, as a CUDA launch does; each of
the assistant's draft steps queues one of `--draft-ms`; and every copy to the host (the sampled
tokens, the drafts: `attention.buffers.HostCopy`) waits for the jobs queued before it, and so does
every other read of a device result the sampler's work makes (`DeviceReads`: the reads that wait for
the stream on CUDA, e.g. a device tensor indexed with a host list, `torch.tensor(..., device=)`,
`.tolist()`, `.item()`, `.cpu()`, boolean indexing; the sampler and prompt logprobs run under it). Every other
piece of a step is the host's real work on this CPU, including what would be device work on a GPU
(the attention metadata builders' tensor ops, the positions moved back, the acceptance), which makes
the host look slower than it is. Attention is flex's (its builder plans from the host's
query_start_loc alone, as FA4's and flex's do on CUDA, so the async loop moves positions on the
device instead of reading the acceptance first).

Row kinds (`--rows`; speculation only with greedy rows): greedy; random (temperature 0.8, top-p 0.9,
top-k 50, every fourth row seeded); penalised (presence, frequency, repetition); logprobs (top 5);
json (one row of the batch constrained by a JSON schema, the rest greedy); prompt_logprobs (greedy
decoders and, every step, a new short request asking for its prompt's logprobs); mix (the decoders
cycle through greedy, random, penalised and logprobs rows, one of them constrained). The logits are
random (seeded), so random and constrained rows walk their distributions and grammars.

Per case (loop, rows, requests, speculation): the step period in steady decode, the host's work per step
(the period less the time the host waited for the device; `host_cpu`: the step thread's CPU time less
its spin on the device, which a shared machine's preemptions do not inflate), medians over the timed steps, the best
of `--repeats` runs, and the device time per step (forward, plus K draft steps with speculation);
the ratio is period / max(host, device): 1.00x is the host entirely hidden (or the device
entirely), and the synchronous loop's is (host + device) / max(host, device).

Tensor-parallel cases (`--tp 2`): greedy rows at 1/16 requests, with and without speculation, in a
TP=2 group over gloo (a real spawned worker rank, the step messages through the shared-memory ring,
the in-flight tokens by a gloo broadcast, or with speculation the async drafting round's
acceptance, from which every rank builds them: one broadcast a step), the simulated
device on every rank: each rank's forward, logits, draft steps and the drafter's token embedding
are stubs that return at once, so the layers' collectives (NCCL on a GPU, queued on the stream) are part of `--device-ms` and do not
run; what runs is every host step of both ranks and the collectives of the protocol itself. Gloo's
broadcast is synchronous where NCCL's is queued: rank 0's host waits there until the worker has
read the step (`coll` in the line: rank 0's time blocked in those broadcasts, counted as host
time), so the TP rows are an upper bound on what the protocol costs rank 0's host on a GPU; their
`host_cpu` leaves out every wait (those broadcasts, and a core held by the worker or others).

Profile (`--profile`): the async loop at 64 greedy requests, with and without speculation, its host
time per step split by the functions it runs in (exclusive thread CPU time: a function's own, less the listed
functions it calls; medians per step), each marked as host work on a GPU too (scheduling, step
inputs, the sampler's planning, the acceptance and its layout for the device, records and outputs:
Python and numpy) or as device work that runs here as CPU tensor ops (flex's block-mask build, the
sampler's batched ops, the device acceptance and the next inputs built from it, the drafter's rope
and steps, the positions moved back, the tokens in flight copied into the inputs, and the simulated
forward and logits). Run without `DeviceReads` (its
__torch_function__ hook costs host time of its own; greedy rows read nothing either way).

Video cases (encode-ahead, #35 item 5): 16 requests decode, then a video of 32 frames arrives and
prefills beside them (64-token steps: a few frames a step). The vision tower takes `--tower-ms`
of simulated device time per frame: encoded in the step that consumes the frames
(`--no-encode-ahead`) it is queued on the step's stream before the forward; encoded ahead it is
queued on a side stream, which the simulation lets overlap the main one entirely (a GPU shares
its SMs between them: the overlap is an upper bound), and a step's forward starts once the side
stream's jobs queued by the steps before it have ended (the event it waits on). Per case: the
decoders' median step period while the video prefills over their period alone before it
arrived (the GPU target, <= 1.5x at 12B dims, is measured on a GPU, not here).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from device_reads import DeviceReads
from serving import machine

import mmserve.core.async_loop as async_loop_module
import mmserve.sample.sampler as sampler_module
import mmserve.worker.model_runner as model_runner_module
from mmserve.config import DEMO_ASSISTANT_DIR, DEMO_MODEL_DIR, EngineConfig
from mmserve.core.engine_core import EngineCore
from mmserve.engine.types import EngineRequest
from mmserve.request import MultiModalInput
from mmserve.sampling_params import ResponseFormat, SamplingParams

logger = logging.getLogger("bench.async_overlap")
RESULTS = Path(__file__).resolve().parent / "results" / "async_overlap.json"
K = 3   # drafts per request per step with speculation
ROW_KINDS = ("greedy", "random", "penalised", "logprobs", "json", "prompt_logprobs", "mix")
_PROMPT_LOGPROBS = model_runner_module.prompt_logprobs
JSON_SCHEMA = json.dumps({"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]})


class SimulatedDevice:
    """One stream, as a timeline: a job starts when it is queued or when the job before it ends,
    whichever is later, and ends its device time after; waiting for a job sleeps until its end.
    No thread runs the jobs, so the host's Python (and the GIL) never delays the device, as on a
    GPU. `waited` is the host's time blocked on jobs, `waited_cpu` the thread CPU time its spin took."""

    def __init__(self) -> None:
        self._free_at = 0.0
        self.side_free_at = 0.0   # a second stream (encode-ahead's), running beside the first
        self.waited = 0.0
        self.waited_cpu = 0.0

    def submit(self, seconds: float, after: float = 0.0) -> float:
        """Queue a job, starting no earlier than `after` (an event on another stream); returns when
        it ends (perf_counter)."""
        self._free_at = max(time.perf_counter(), self._free_at, after) + seconds
        return self._free_at

    def submit_side(self, seconds: float) -> float:
        """Queue a job on the side stream, which overlaps the main one entirely."""
        self.side_free_at = max(time.perf_counter(), self.side_free_at) + seconds
        return self.side_free_at

    @property
    def busy_until(self) -> float:
        """When the last job queued ends."""
        return self._free_at

    def wait(self, end: float) -> None:
        start, start_cpu = time.perf_counter(), time.thread_time()
        while time.perf_counter() < end:   # a spin: a sleep would overshoot by the OS's wake-up, as a
            pass                           # device event's spin-wait does not
        self.waited += time.perf_counter() - start
        self.waited_cpu += time.thread_time() - start_cpu


def simulate(core: EngineCore, device: SimulatedDevice, device_s: float, draft_s: float) -> DeviceReads:
    """The model's forward and each draft step become queued device jobs (`device_s`, `draft_s`;
    their outputs zeros, the logits seeded random, at once); a copy to the host is there once every
    job queued before it has run; the synchronous loop's drafts, read with `.tolist()`, once the
    draft steps have; the sampler's and prompt logprobs' reads of device results (`DeviceReads`,
    returned) once every job queued before them has."""
    model, hidden_size, vocab = core.model, core.model.spec.hidden_size, core.model.spec.vocab_size
    reads = DeviceReads(lambda: device.wait(device.busy_until))
    logits_gen = torch.Generator().manual_seed(0)

    def forward(input_ids, *args, **kwargs):
        device.submit(device_s)   # returns at once, as a launch does
        rows = kwargs.get("inputs_embeds", input_ids).shape[0]
        return torch.zeros(rows, hidden_size)

    model.forward = forward
    model.compute_logits = lambda hidden: torch.randn(hidden.shape[0], vocab, generator=logits_gen)

    core.sampler.launch = reads.around(core.sampler.launch, 0)
    model_runner_module.prompt_logprobs = reads.around(_PROMPT_LOGPROBS, 1)

    class SimulatedCopy:
        def __init__(self, tensor: torch.Tensor):
            self._host, self._end = tensor.clone(), device.busy_until

        def result(self) -> torch.Tensor:
            device.wait(self._end)
            return self._host

    for module in (sampler_module, async_loop_module):
        module.HostCopy = SimulatedCopy
    if core.speculator is not None:
        assistant = core.speculator.assistant

        def draft_step(token_embeds, hidden, rope, shared):
            device.submit(draft_s)
            return torch.zeros(hidden.shape[0], vocab), torch.zeros_like(hidden)

        assistant.step = draft_step
        draft = core.speculator.draft

        def draft_then_read(*args, **kwargs):   # the synchronous loop's drafts reach the host by .tolist()
            drafts = draft(*args, **kwargs)
            device.wait(device.busy_until)
            return drafts

        core.speculator.draft = draft_then_read
    return reads


def _stub_rank(model) -> None:
    """A worker rank's model as the simulated device's: forward and logits return at once (zeros),
    and so does the embedding the drafter reads (its all-reduce is device work on a GPU)."""
    hidden_size, vocab = model.spec.hidden_size, model.spec.vocab_size
    model.forward = lambda input_ids, *args, **kwargs: torch.zeros(
        kwargs.get("inputs_embeds", input_ids).shape[0], hidden_size)
    model.compute_logits = lambda hidden: torch.zeros(hidden.shape[0], vocab)
    stub_embedding(model)


def stub_embedding(model) -> None:
    """Under tensor parallelism the drafter's token embedding all-reduces over the vocab shards: on a
    GPU that is device work on the stream, so the simulation makes it a stub on every rank."""
    hidden_size = model.spec.hidden_size
    model.decoder.embed = lambda ids, *args: torch.zeros(ids.shape[0], hidden_size, dtype=model.dtype)


def simulated_worker_main(rank, *args) -> None:
    """A TP worker rank (spawned) whose model and drafter are stubs, as `simulate` makes rank 0's."""
    from mmserve.executor import worker_rank
    from mmserve.spec_decode.speculator import Speculator

    load_rank_model, load_speculator = worker_rank.load_rank_model, Speculator.load

    def stubbed_model(config, group):
        model = load_rank_model(config, group)
        _stub_rank(model)
        return model

    def stubbed_speculator(*a, **kw):
        speculator = load_speculator(*a, **kw)
        speculator.assistant.step = lambda embeds, hidden, rope, shared: (
            torch.zeros(hidden.shape[0], speculator.target.spec.vocab_size), torch.zeros_like(hidden))
        return speculator

    worker_rank.load_rank_model, Speculator.load = stubbed_model, staticmethod(stubbed_speculator)
    worker_rank.worker_main(rank, *args)


def tp_core(config: EngineConfig):
    """Rank 0's core over a TP group whose worker ranks run `simulated_worker_main`; returns (core,
    group, a list rank 0's time blocked in broadcasts accumulates into: with the forward stubbed,
    those are the protocol's own: the in-flight tokens, or the async drafting round's acceptance)."""
    from mmserve.executor import ranks, tensor_parallel
    from mmserve.model.parallel import ParallelGroup

    worker_main = tensor_parallel.worker_main
    tensor_parallel.worker_main = simulated_worker_main
    try:
        tp = tensor_parallel.TensorParallelGroup(config, log_level=logging.WARNING)
    finally:
        tensor_parallel.worker_main = worker_main
    core = EngineCore(config, model=ranks.load_rank_model(config, tp.group), runner_factory=tp.runner_factory)
    stub_embedding(core.model)
    if core.speculator is not None:
        tp.runner.serve_drafts(core.speculator)
    blocked, broadcast = [0.0], ParallelGroup.broadcast

    def timed(self, x):
        start = time.perf_counter()
        try:
            return broadcast(self, x)
        finally:
            blocked[0] += time.perf_counter() - start

    ParallelGroup.broadcast = timed   # this process only: rank 0 (restored by `close`)

    def close() -> None:
        ParallelGroup.broadcast = broadcast
        tp.close()

    return core, close, blocked


def simulate_tower(core: EngineCore, device: SimulatedDevice, tower_s: float) -> None:
    """The vision tower becomes a queued job of `tower_s` per frame (zeros of each frame's soft
    tokens, at once): on the main stream inside a step, on the side stream when the runner encodes
    ahead; each step's forward starts after the side stream's jobs queued before the step began."""
    runner, model = core.runner, core.model
    pooled = model.spec.pooling_kernel_size ** 2
    ahead, forward, execute, encode_ahead = [False], model.forward, runner.execute, runner._encode_ahead
    ready = [0.0]

    def tower(pixels, positions):
        (device.submit_side if ahead[0] else device.submit)(tower_s * pixels.shape[0])
        return [torch.zeros(int((p[:, 0] >= 0).sum()) // pooled, model.spec.hidden_size) for p in positions]

    def encoding_ahead(items):
        ahead[0] = True
        try:
            return encode_ahead(items)
        finally:
            ahead[0] = False

    def stepping(out, prev=None):
        ready[0] = device.side_free_at   # what the steps before encoded ahead: this step's forward waits for it
        return execute(out, prev)

    def forward_after(input_ids, *args, **kwargs):
        device._free_at = max(device._free_at, ready[0])
        return forward(input_ids, *args, **kwargs)

    model.encode_vision, runner._encode_ahead, runner.execute, model.forward = (
        tower, encoding_ahead, stepping, forward_after)


def video_request(spec, rid: str, frames: int, seed: int) -> EngineRequest:
    """A prompt of `frames` video frames of 8 x 8 patches (16 soft tokens each) and some text."""
    gen = torch.Generator().manual_seed(seed)
    side, patch = 8, spec.patch_size
    gx, gy = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy")
    positions = torch.stack([gx, gy], -1).reshape(-1, 2)
    tokens = side * side // spec.pooling_kernel_size ** 2
    ids, ranges, inputs = [spec.bos_token_id], [], []
    for _ in range(frames):
        ids += [20, spec.boi_token_id]
        ranges.append((len(ids), len(ids) + tokens - 1))
        ids += [spec.video_token_id] * tokens + [spec.eoi_token_id]
        inputs.append(MultiModalInput(torch.rand(side * side, 3 * patch * patch, generator=gen), positions))
    ids += [30 + i for i in range(6)]
    return EngineRequest(rid, ids, ranges, inputs, SamplingParams(max_tokens=2, ignore_eos=True), num_frames=frames,
                         num_mm_tokens=frames * tokens)


def measure_video(loop: str, ahead: bool, device_ms: float, tower_ms: float, frames: int, steps: int) -> dict:
    """16 decoders' median step period while a `frames`-frame video prefills beside them, and alone."""
    decoders, max_tokens = 16, 4 * steps + 64
    config = EngineConfig(model=str(DEMO_MODEL_DIR), device="cpu", attention_backend="flex", max_num_seqs=decoders + 1,
                          max_num_batched_tokens=64, block_size=16, encode_ahead=ahead,
                          num_kv_blocks=decoders * (-(-(8 + max_tokens) // 16) + 2) + frames * 2 + 16,
                          async_scheduling="on" if loop == "async" else "off")
    core = EngineCore(config)
    device = SimulatedDevice()
    simulate(core, device, device_ms / 1e3, 0.0)
    simulate_tower(core, device, tower_ms / 1e3)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(decoders):
        core.add_request(EngineRequest(f"r{i}", [2] + [10 + (i + j) % 200 for j in range(7)], sampling=sampling))
    while core.scheduler.waiting or any(r.is_prefill for r in core.scheduler.running):
        core.step()
    for _ in range(3):
        core.step()

    def period() -> float:
        start = time.perf_counter()
        core.step()
        return time.perf_counter() - start

    alone = statistics.median(period() for _ in range(steps))
    core.add_request(video_request(core.model.spec, "video", frames, seed=frames))
    beside = []
    while (video := core.requests.get("video")) is not None and (video.is_prefill or not beside):
        beside.append(period())
    assert core.async_scheduling == (loop == "async") and len(beside) > 2
    return dict(loop=loop, encode="ahead" if ahead else "in-step", device_ms=device_ms, tower_ms=tower_ms,
                frames=frames, steps_beside=len(beside), alone_ms=round(alone * 1e3, 3),
                beside_ms=round(statistics.median(beside) * 1e3, 3), ratio=round(statistics.median(beside) / alone, 3))


def row_params(kind: str, i: int, max_tokens: int) -> SamplingParams:
    """Request i's sampling parameters in a batch of `kind` rows (module docstring)."""
    if kind == "mix":
        kind = "json" if i == 0 else ("greedy", "random", "penalised", "logprobs")[i % 4]
    base = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if kind == "random":
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=50,
                              seed=i if i % 4 == 0 else None)
    if kind == "penalised":
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.3,
                              repetition_penalty=1.2)
    if kind == "logprobs":
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=True, top_logprobs=5)
    if kind == "json" and i == 0:
        return SamplingParams(max_tokens=max_tokens, response_format=ResponseFormat("json_schema", JSON_SCHEMA))
    return base


def measure(loop: str, num_reqs: int, speculate: bool, device_ms: float, draft_ms: float, steps: int,
            kind: str = "greedy", tp: int = 1) -> dict:
    max_tokens = (steps + 16) * (1 + K if speculate else 1)
    arrivals = kind == "prompt_logprobs"   # a new request asking for its prompt's logprobs every step
    config = EngineConfig(model=str(DEMO_MODEL_DIR), device="cpu", attention_backend="flex",
                          max_num_seqs=num_reqs + 2 * arrivals, max_num_batched_tokens=max(256, (1 + K) * num_reqs),
                          block_size=16, num_kv_blocks=num_reqs * (-(-(8 + max_tokens + K) // 16) + 2) + 8,
                          async_scheduling="on" if loop == "async" else "off",
                          **(dict(tensor_parallel_size=tp, engine_threads=tp) if tp > 1 else {}),
                          **(dict(speculative_model=str(DEMO_ASSISTANT_DIR), num_speculative_tokens=K)
                             if speculate else {}))
    close, blocked = None, [0.0]
    if tp > 1:
        core, close, blocked = tp_core(config)
    else:
        core = EngineCore(config)
    try:
        return _measure(core, loop, num_reqs, speculate, device_ms, draft_ms, steps, kind, max_tokens, blocked) | {"tp": tp}
    finally:
        if close is not None:
            close()


def _measure(core, loop, num_reqs, speculate, device_ms, draft_ms, steps, kind, max_tokens, blocked) -> dict:
    arrivals = kind == "prompt_logprobs"
    device = SimulatedDevice()
    reads = simulate(core, device, device_ms / 1e3, draft_ms / 1e3)
    device_ms += K * draft_ms if speculate else 0.0
    for i in range(num_reqs):
        core.add_request(EngineRequest(f"r{i}", [2] + [10 + (i + j) % 200 for j in range(7)],
                                       sampling=row_params(kind, i, max_tokens)))
    while core.scheduler.waiting or any(r.is_prefill for r in core.scheduler.running):
        core.step()
    for _ in range(3):   # into steady decode: the pipeline full, the buffers grown
        core.step()
    scored = SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=True, top_logprobs=5)
    periods, hosts, host_cpus, colls = [], [], [], []
    reads.sites.clear()
    for step in range(steps):   # medians: on a shared machine a step the OS preempted is an outlier
        if arrivals:
            core.add_request(EngineRequest(f"p{step}", [2] + [40 + (step + j) % 200 for j in range(7)],
                                           sampling=scored))
        start, waited, coll = time.perf_counter(), device.waited, blocked[0]
        start_cpu, waited_cpu = time.thread_time(), device.waited_cpu
        core.step()
        periods.append(time.perf_counter() - start)
        hosts.append(periods[-1] - (device.waited - waited))
        host_cpus.append(time.thread_time() - start_cpu - (device.waited_cpu - waited_cpu))
        colls.append(blocked[0] - coll)
    period, host = statistics.median(periods), statistics.median(hosts)
    assert core.async_scheduling == (loop == "async")
    return dict(loop=loop, rows=kind, requests=num_reqs, speculation=speculate, device_ms=device_ms,
                period_ms=round(period * 1e3, 3), host_ms=round(host * 1e3, 3),
                host_cpu_ms=round(statistics.median(host_cpus) * 1e3, 3),
                collective_ms=round(statistics.median(colls) * 1e3, 3),
                ratio=round(period / max(host, device_ms / 1e3), 3),
                reads_per_step=round(sum(reads.sites.values()) / steps, 1), read_sites=dict(reads.sites.most_common()))


# (label, host work on a GPU too?, the functions timed under it). A call's exclusive time goes to its
# label; what the listed functions do not cover goes to "the loop's own Python" (EngineCore.step).
PROFILED = (
    ("scheduler: schedule", True, [("mmserve.core.sched.scheduler:Scheduler", "schedule")]),
    ("scheduler: update after a step", True, [("mmserve.core.sched.scheduler:Scheduler", "update")]),
    ("step inputs (numpy over the batch)", True, [("mmserve.worker.step_inputs:StepInputBuilder", "build")]),
    ("block table deltas", True, [("mmserve.worker.block_table:BlockTables", "apply")]),
    ("flex: row layout (numpy)", True, [("mmserve.attention.flex:FlexMetadataBuilder", "_fill_rows")]),
    ("sampler: planning and queuing", True, [("mmserve.sample.sampler:Sampler", "launch")]),
    ("acceptance: the device's layout (numpy)", True, [("mmserve.core.async_loop", "acceptance_layout")]),
    ("sampler: tokens to lists", True, [("mmserve.sample.sampler:PendingSample", "result")]),
    ("acceptance on the host", True, [("mmserve.sample.rejection_sampler:RejectionSampler", "accept")]),
    ("rows to sample (verify rows)", True, [("mmserve.core.async_loop", "verify_rows")]),
    ("runner: the step's launch around them", True, [("mmserve.worker.model_runner:ModelRunner", "execute")]),
    ("core: launching the sampling, finishing a step", True,
     [("mmserve.core.async_loop:AsyncLoop", "_launch_sampling"), ("mmserve.core.async_loop:AsyncLoop", "_finish"),
      ("mmserve.core.engine_core:EngineCore", "_conclude"), ("mmserve.core.async_loop:AsyncLoop", "_accept_and_draft")]),
    ("drafter: planning a round", True, [("mmserve.spec_decode.speculator:Speculator", "propose_on_device")]),
    ("step record", True, [("mmserve.core.engine_core:EngineCore", "_record")]),
    ("outputs", True, [("mmserve.core.engine_core:EngineCore", "_emit")]),
    ("the loop's own Python", True, [("mmserve.core.engine_core:EngineCore", "step")]),
    ("flex: tables and block mask (tensor ops)", False,
     [("mmserve.attention.flex:FlexMetadataBuilder", "_fill_tables"),
      ("mmserve.attention.flex:FlexMetadataBuilder", "_fill_block_mask")]),
    ("sampler: its batched ops (tensor ops)", False, [("mmserve.sample.sampler:Sampler", "_queue")]),
    ("acceptance on the device, next inputs (tensor ops)", False,
     [("mmserve.core.async_loop", "accept_on_device"), ("mmserve.core.async_loop", "next_step_inputs"),
      ("mmserve.spec_decode.speculator", "next_step_inputs")]),
    ("drafter: its steps (embed, rope, draft)", False,
     [("mmserve.spec_decode.speculator:Speculator", "_loop"), ("mmserve.model.assistant:Assistant", "rope")]),
    ("positions moved back (tensor ops)", False, [("mmserve.worker.step_inputs:StepInputBuilder", "shift_on_device")]),
    ("tokens in flight copied in (tensor ops)", False, [("mmserve.worker.model_runner:ModelRunner", "_build")]),
    ("simulated device: forward and logits", False, []),   # `simulate`'s stubs, wrapped in `profile`
)


class Breakdown:
    """Exclusive thread CPU time per label (a shared machine's preemptions do not count): each
    wrapped call's less the wrapped calls it made; the simulated device's spin-waits are set apart
    (not host time)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys([label for label, _, _ in PROFILED] + ["(waiting for the device)"], 0.0)
        self._stack: list[float] = []
        self._restore: list[tuple[object, str, object]] = []

    def timed(self, fn, label: str):
        def run(*args, **kwargs):
            self._stack.append(0.0)
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                total = time.thread_time() - start
                self.seconds[label] += total - self._stack.pop()
                if self._stack:
                    self._stack[-1] += total
        return run

    def wrap(self, owner, name: str, label: str) -> None:
        self._restore.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, self.timed(getattr(owner, name), label))

    def restore(self) -> None:
        for owner, name, fn in reversed(self._restore):
            setattr(owner, name, fn)


def profile(speculate: bool, device_ms: float, draft_ms: float, steps: int, num_reqs: int = 64) -> dict:
    """The async loop's host time per step at `num_reqs` greedy requests, by `PROFILED` label."""
    import importlib

    max_tokens = (steps + 16) * (1 + K if speculate else 1)
    config = EngineConfig(model=str(DEMO_MODEL_DIR), device="cpu", attention_backend="flex", max_num_seqs=num_reqs,
                          max_num_batched_tokens=max(256, (1 + K) * num_reqs), block_size=16,
                          num_kv_blocks=num_reqs * (-(-(8 + max_tokens + K) // 16) + 2) + 8, async_scheduling="on",
                          **(dict(speculative_model=str(DEMO_ASSISTANT_DIR), num_speculative_tokens=K)
                             if speculate else {}))
    breakdown = Breakdown()
    for label, _, targets in PROFILED:
        for target, name in targets:
            module, _, cls = target.partition(":")
            owner = importlib.import_module(module)
            breakdown.wrap(getattr(owner, cls) if cls else owner, name, label)
    try:
        core = EngineCore(config)
        device = SimulatedDevice()
        device.wait = breakdown.timed(device.wait, "(waiting for the device)")
        launch = core.sampler.launch
        simulate(core, device, device_ms / 1e3, draft_ms / 1e3)
        core.sampler.launch, model_runner_module.prompt_logprobs = launch, _PROMPT_LOGPROBS   # no DeviceReads
        for name in ("forward", "compute_logits"):
            setattr(core.model, name, breakdown.timed(getattr(core.model, name), "simulated device: forward and logits"))
        for i in range(num_reqs):
            core.add_request(EngineRequest(f"r{i}", [2] + [10 + (i + j) % 200 for j in range(7)],
                                           sampling=row_params("greedy", i, max_tokens)))
        while core.scheduler.waiting or any(r.is_prefill for r in core.scheduler.running):
            core.step()
        for _ in range(3):
            core.step()
        per_step: dict[str, list[float]] = {label: [] for label in breakdown.seconds}
        for _ in range(steps):
            before = dict(breakdown.seconds)
            core.step()
            for label, total in breakdown.seconds.items():
                per_step[label].append(total - before[label])
    finally:
        breakdown.restore()
    host = {label: statistics.median(v) * 1e3 for label, v in per_step.items() if label != "(waiting for the device)"}
    totals = [sum(per_step[label][i] for label in host) * 1e3 for i in range(steps)]
    on_gpu = {label for label, gpu, _ in PROFILED if gpu}
    return dict(requests=num_reqs, speculation=speculate, device_ms=device_ms + (K * draft_ms if speculate else 0.0),
                host_ms=round(statistics.median(totals), 3),
                host_on_gpu_ms=round(statistics.median(
                    [sum(per_step[label][i] for label in on_gpu) * 1e3 for i in range(steps)]), 3),
                labels={label: dict(ms=round(ms, 3), host_on_gpu=label in on_gpu) for label, ms in host.items()})


def print_profile(rows: list[dict]) -> None:
    labels = list(rows[0]["labels"])
    print(f"{'host ms per step (medians), async loop':<48}" + "".join(
        f"{'spec ' + ('on' if r['speculation'] else 'off'):>10}" for r in rows) + "  kind")
    for label in labels:
        kind = "host on a GPU too" if rows[0]["labels"][label]["host_on_gpu"] else "device work run on this CPU"
        print(f"{label:<48}" + "".join(f"{r['labels'][label]['ms']:>10.3f}" for r in rows) + f"  {kind}")
    print(f"{'host on a GPU too (median of the sums)':<48}" + "".join(f"{r['host_on_gpu_ms']:>10.3f}" for r in rows))
    print(f"{'all host time here (median of the sums)':<48}" + "".join(f"{r['host_ms']:>10.3f}" for r in rows))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="1 and 16 requests, 5 steps, greedy and mix rows; JSON to a temp file")
    p.add_argument("--device-ms", type=float, default=None,
                   help="the simulated device's time per forward (default: about the host's at 16 requests)")
    p.add_argument("--draft-ms", type=float, default=0.1,
                   help="the simulated device's time per draft step of the assistant (K = 3 a step)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3, help="runs per case; the one with the shortest period is kept "
                                                            "(on a shared machine the others waited for the CPU)")
    p.add_argument("--tower-ms", type=float, default=1.0, help="the simulated vision tower's time per frame")
    p.add_argument("--video", action="store_true", help="only the video cases (encode in the step vs ahead)")
    p.add_argument("--loops", nargs="+", choices=("sync", "async"), default=["sync", "async"],
                   help="the loops to run (a checkout whose async loop refuses a case: sync)")
    p.add_argument("--tp", type=int, default=1, help="2: only the tensor-parallel cases (greedy rows, TP=2 over gloo)")
    p.add_argument("--rows", nargs="+", choices=ROW_KINDS, default=list(ROW_KINDS),
                   help="the row kinds to run (greedy: 1/16/64 requests with and without speculation; the others "
                        "16/64 without)")
    p.add_argument("--profile", action="store_true",
                   help="only the host-time breakdown of the async loop at 64 greedy requests (module docstring)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.profile:
        steps = 5 if args.smoke else args.steps
        load_before = os.getloadavg()
        rows = [profile(spec, args.device_ms or 3.0, args.draft_ms, steps, num_reqs=16 if args.smoke else 64)
                for spec in (False, True)]
        print_profile(rows)
        print(f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs")
        out = args.out or (Path(tempfile.mkdtemp()) / "async_overlap_profile.json" if args.smoke
                           else RESULTS.with_name("async_overlap_profile.json"))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"machine": machine(), "steps": steps, "load_avg_before": load_before,
                                   "load_avg": os.getloadavg(), "rows": rows}, indent=2))
        logger.warning("wrote %s", out)
        return 0
    counts = (1, 16) if args.smoke else (1, 16, 64)
    steps = 5 if args.smoke else args.steps
    args.repeats = 1 if args.smoke else args.repeats
    if args.smoke and args.rows == list(ROW_KINDS):
        args.rows = ["greedy", "mix"]   # mix holds random, penalised, logprob and constrained rows
    device_ms = args.device_ms or (1.0 if args.smoke else 3.0)
    load_before = os.getloadavg()
    if args.tp > 1:   # greedy rows at 1 and 16 requests (module docstring)
        counts, args.rows = (1, 16), ["greedy"]
    cases = [] if args.video else (
        [("greedy", spec, n) for spec in (False, True) for n in counts] * ("greedy" in args.rows)
        + [(kind, False, n) for kind in args.rows if kind != "greedy" for n in counts if n > 1])
    rows = [min((measure(loop, n, spec, device_ms, args.draft_ms, steps, kind, args.tp) for _ in range(args.repeats)),
                key=lambda r: r["period_ms"])
            for kind, spec, n in cases for loop in args.loops]
    for r in rows:
        tp = f"tp={r['tp']} coll={r['collective_ms']:.2f}ms " if r["tp"] > 1 else ""
        print(f"loop={r['loop']:<5} {tp}rows={r['rows']:<15} requests={r['requests']:<3} "
              f"speculation={'on ' if r['speculation'] else 'off'} device={r['device_ms']:.1f}ms "
              f"host={r['host_ms']:.2f}ms host_cpu={r['host_cpu_ms']:.2f}ms period={r['period_ms']:.2f}ms "
              f"reads/step={r['reads_per_step']:<5} "
              f"{r['ratio']:.2f}x")
    frames = 8 if args.smoke else 32
    video = [] if args.tp > 1 or (args.rows != list(ROW_KINDS) and not args.video) else [min((measure_video(loop, ahead, device_ms, args.tower_ms, frames, steps) for _ in range(args.repeats)),
                 key=lambda r: r["beside_ms"])
             for loop in args.loops for ahead in (False, True)]
    for r in video:
        print(f"loop={r['loop']:<5} video={r['frames']} frames beside 16 decodes, encode={r['encode']:<8} "
              f"device={r['device_ms']:.1f}ms tower={r['tower_ms']:.1f}ms/frame alone={r['alone_ms']:.2f}ms "
              f"beside={r['beside_ms']:.2f}ms {r['ratio']:.2f}x")
    if args.smoke and args.tp == 1:   # the profile's machinery, at 16 requests without speculation
        print_profile([profile(False, device_ms, args.draft_ms, steps, num_reqs=16)])
    print(f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs")
    out = args.out or (Path(tempfile.mkdtemp()) / "async_overlap.json" if args.smoke
                       else RESULTS.with_name("async_overlap_video.json") if args.video
                       else RESULTS.with_name("async_overlap_tp.json") if args.tp > 1 else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "device_ms": device_ms, "draft_ms": args.draft_ms, "steps": steps,
                               "repeats": args.repeats, "load_avg_before": load_before, "load_avg": os.getloadavg(),
                               "tower_ms": args.tower_ms, "rows": rows, "video_rows": video}, indent=2))
    logger.warning("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
