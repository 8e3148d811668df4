"""The KV cache sized from the device's memory: vLLM's `--gpu-memory-utilization`.

The engine may use `utilization` x the device's memory in all. Once the model (and the drafter) is
loaded, and before the KV cache is allocated or CUDA graphs are captured, `profile_memory` runs the
largest step the configuration allows (`profiling_step`: the step budget over `max_num_seqs`
requests that all sample, the first one filling it with max-size images, the vision tower's largest
batch, and as many other images encoded ahead for the next step (`--encode-ahead`: on CUDA on a side
stream, their embeddings held); then the sampler with every option that holds [rows, vocabulary]
tensors at once (`PROFILING_SAMPLING`), the penalty tables at `--max-num-seqs` rows, the first
request's prompt logprobs, and with a speculative model one drafting round for every request) on a runner whose pools hold just that step, except the full-attention pools, which hold
one full context so that attention work sized by the cache (flex's block mask) is measured at
serving size. The allocator's peak over what that runner held before the step is the activation
peak. Two more runners, each with one pool 256 blocks larger, tell what a runner allocates per block
beyond the K/V (buffers that grow with the pool); the planner prices blocks with it. The KV cache gets what
the weights, the runner's fixed buffers, the activation peak and the memory that appeared outside
torch's allocator since start-up (cuBLAS and NCCL workspaces) leave of the budget. CUDA graphs' own
pool is not in the profile (vLLM's flag did not count it either): 1 - utilization is its room.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from mmserve.config import CPU_KV_CACHE_BYTES, EngineConfig
from mmserve.core.kv_cache.manager import KVCacheManager
from mmserve.core.kv_cache.planner import KVCacheTooSmall, plan_pools, size_text
from mmserve.core.sched.output import SchedulerOutput
from mmserve.core.sched.scheduler import Scheduler
from mmserve.multimodal.preprocess import num_soft_tokens, preprocess_images, target_size
from mmserve.request import MultiModalInput, Request
from mmserve.sample.sampler import Sampler
from mmserve.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from mmserve.spec_decode.speculator import DraftFrom
from mmserve.spec_decode.verify import verify_rows

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemorySnapshot:
    free: int        # on the device, for anyone
    total: int
    allocated: int   # by this process's torch allocator, in tensors
    reserved: int    # by this process's torch allocator, from the device

    @property
    def outside_torch(self) -> int:
        """Device memory in use that torch's allocator did not reserve (other processes, this
        process's CUDA context and library workspaces)."""
        return self.total - self.free - self.reserved


class DeviceMemory:
    """torch.cuda's memory figures for one device."""

    def __init__(self, device: torch.device):
        self.device = device

    def snapshot(self) -> MemorySnapshot:
        free, total = torch.cuda.mem_get_info(self.device)
        return MemorySnapshot(free, total, torch.cuda.memory_allocated(self.device),
                              torch.cuda.memory_reserved(self.device))

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def release(self) -> None:
        """Return what freed tensors left cached in the allocator, so the next figures are exact."""
        gc.collect()
        torch.cuda.empty_cache()


def device_memory(device: torch.device) -> DeviceMemory | None:
    """The memory reader of `device`: a CUDA device's. A CPU has none: its KV cache is a fixed size
    (`CPU_KV_CACHE_BYTES`), the host's memory being shared with everything else."""
    return DeviceMemory(device) if device.type == "cuda" else None


@dataclass(frozen=True)
class MemoryProfile:
    total: int
    utilization: float
    weights: int            # torch memory before any runner: the weights, the drafter
    runner_fixed: int       # a runner's buffers that do not grow with its pools
    activations: int        # the profiling step's peak over what its runner held
    outside_torch: int      # device memory that appeared outside torch's allocator since start-up
    block_overhead: dict[str, int]   # per pool: what a runner allocates per block beyond the K/V

    @property
    def budget(self) -> int:
        return int(self.total * self.utilization)

    @property
    def kv_cache_bytes(self) -> int:
        return self.budget - self.weights - self.runner_fixed - self.activations - self.outside_torch

    def describe(self) -> str:
        parts = [("weights", self.weights), ("runner buffers", self.runner_fixed),
                 ("activation peak", self.activations), ("outside torch", self.outside_torch)]
        return (f"--gpu-memory-utilization {self.utilization} of {size_text(self.total)} = {size_text(self.budget)}: "
                + ", ".join(f"{name} {size_text(n)}" for name, n in parts) + f", KV cache {size_text(self.kv_cache_bytes)}")


def _image(rng: np.random.Generator, spec, tokens_wanted: int) -> tuple[MultiModalInput, int]:
    """A random image at the largest size preprocessing makes (its soft tokens), patchified."""
    th, tw = target_size(4096, 4096, patch_size=spec.patch_size, pooling_kernel_size=spec.pooling_kernel_size,
                         max_soft_tokens=tokens_wanted)
    pixels = rng.integers(0, 256, (th, tw, 3), dtype=np.uint8)
    batch = preprocess_images([pixels], patch_size=spec.patch_size, pooling_kernel_size=spec.pooling_kernel_size,
                              max_soft_tokens=tokens_wanted, resized=True)
    tokens = num_soft_tokens(th, tw, patch_size=spec.patch_size, pooling_kernel_size=spec.pooling_kernel_size,
                             max_soft_tokens=tokens_wanted)
    return MultiModalInput(batch.pixel_values[0], batch.position_ids[0]), tokens


# What a step's rows may ask for that holds [rows, vocabulary] tensors on the device at once: the
# logprobs' copy of the raw logits and their log-softmax, the adjusted copy, the penalties' gathered
# counts and prompt bitmask, top-k/top-p's filtered probabilities, a seeded row's float64 CDF (every
# row seeded: each also draws the batch's noise). Bias, min_tokens and grammar masks hold less.
PROFILING_SAMPLING = SamplingParams(max_tokens=1, temperature=1.0, top_k=50, top_p=0.9, seed=0, logprobs=True,
                                    top_logprobs=MAX_TOP_LOGPROBS, repetition_penalty=1.1, frequency_penalty=0.5,
                                    presence_penalty=0.5)


def profiling_requests(spec, config: EngineConfig, max_model_len: int, seed: int = 0) -> list[Request]:
    """The largest step the configuration allows, as requests: `max_num_seqs` of them (or one per
    token of a smaller budget) share the step budget, all sampling with `PROFILING_SAMPLING`; the
    first holds the rest of the budget: as many of the largest images admission allows as fit it
    (with a vision tower: the encoder's largest batch), then text, and asks for its prompt's logprobs
    (their logits, up to `PROMPT_LOGITS_ROWS` rows at a time)."""
    budget = config.max_step_tokens
    count = min(config.max_num_seqs, budget)
    text = min(1000, spec.vocab_size - 1)
    sampling = PROFILING_SAMPLING
    first = min(budget - (count - 1), max_model_len - 1)
    ids, ranges, inputs = [spec.bos_token_id], [], []
    rng = np.random.default_rng(seed)
    largest = min(spec.image_max_soft_tokens, config.max_num_batched_tokens)   # an image admission allows
    while spec.has_vision and len(ids) + largest + 2 <= first:
        item, tokens = _image(rng, spec, largest)
        ids.append(spec.boi_token_id)
        ranges.append((len(ids), len(ids) + tokens - 1))
        ids += [spec.image_token_id] * tokens + [spec.eoi_token_id]
        inputs.append(item)
    ids += [text] * (first - len(ids))
    out = [Request("profile-0", ids, dataclasses.replace(sampling, prompt_logprobs=True), mm_ranges=ranges,
                   mm_inputs=inputs)]
    return out + [Request(f"profile-{i}", [text], sampling) for i in range(1, count)]


def profiling_step(requests: list[Request], kv: KVCacheManager, config: EngineConfig,
                   max_model_len: int) -> SchedulerOutput:
    """One step of all of `requests`, scheduled as serving schedules them."""
    budget = config.max_step_tokens
    scheduler = Scheduler(kv, max_num_batched_tokens=budget, prefill_batched_tokens=budget,
                          max_num_seqs=len(requests), max_model_len=max_model_len)
    for r in requests:
        scheduler.enqueue(r)
    out = scheduler.schedule()
    if len(out.scheduled) != len(requests):
        raise RuntimeError(f"the profiling step scheduled {len(out.scheduled)} of {len(requests)} requests")
    scheduler.update(out)
    return out


OVERHEAD_PROBE_BLOCKS = 256   # blocks one pool grows by to measure a runner's per-block overhead


def _profile_plans(model, config: EngineConfig, requests: list[Request], max_model_len: int, free_bytes: int,
                   larger: str | None = None):
    """Pools for the profiling step: each request's blocks, a full-attention pool one full context
    (or what a quarter of the free memory holds, when less: a device too small for more would refuse
    the plan anyway). `larger`: that pool OVERHEAD_PROBE_BLOCKS larger (the overhead's second point)."""
    bs = config.block_size
    step_blocks = 1 + sum(math.ceil(r.num_tokens / bs) for r in requests)
    spec = model.spec
    plan = plan_pools(spec.kv_layer_types, spec.attention_specs, block_size=bs, dtype_bytes=model.dtype.itemsize,
                      num_kv_blocks=step_blocks)
    full_cost = sum(p.bytes_per_block for p in plan.pools.values() if p.window is None) or 1
    context = min(1 + math.ceil(max_model_len / bs), free_bytes // 4 // full_cost)
    pools = {t: dataclasses.replace(p, num_blocks=max(step_blocks, context) if p.window is None else step_blocks)
             for t, p in plan.pools.items()}
    if larger is not None:
        pools[larger] = dataclasses.replace(pools[larger], num_blocks=pools[larger].num_blocks + OVERHEAD_PROBE_BLOCKS)
    return pools


def profile_memory(model, config: EngineConfig, *, max_model_len: int, memory: DeviceMemory,
                   baseline: MemorySnapshot, speculator=None) -> tuple[MemoryProfile, list]:
    """Measure what the largest step needs beside the weights (see the module's docstring); also the
    attention backends' start-up self-check results of the runner it ran on (a backend that fell
    back there is the one profiled, and the one that serves). `baseline`: the device before the
    model was loaded."""
    from mmserve.worker.model_runner import ModelRunner

    budget = int(baseline.total * config.gpu_memory_utilization)
    if baseline.free + baseline.reserved < budget:
        raise ValueError(
            f"--gpu-memory-utilization {config.gpu_memory_utilization} asks for {size_text(budget)} of the "
            f"device's {size_text(baseline.total)}, but only {size_text(baseline.free + baseline.reserved)} "
            f"were free at start-up (other processes hold the rest): lower it, or free the device")
    profile_config = dataclasses.replace(config, enforce_eager=True)   # graphs are captured after sizing
    requests = profiling_requests(model.spec, config, max_model_len)
    ahead = None   # the next step's images, encoded after the forward (other content: the cache lacks them)
    if config.encode_ahead and requests[0].mm_inputs:
        ahead = profiling_requests(model.spec, config, max_model_len, seed=1)[0]
    memory.release()
    before = memory.snapshot()
    weights = before.allocated

    def runner_bytes(larger: str | None):
        pools = _profile_plans(model, config, requests, max_model_len, before.free, larger)
        quiet = profile_config if larger is None else dataclasses.replace(profile_config, backend_self_check="off")
        runner = ModelRunner(model, pools, quiet, max_model_len=max_model_len)
        return runner, pools, memory.snapshot().allocated - weights

    runner, pools, held = runner_bytes(None)
    kv = KVCacheManager(pools, config.block_size, max_model_len=max_model_len, enable_prefix_caching=False)
    out = profiling_step(requests, kv, config, max_model_len)
    if ahead is not None:
        out.encode_ahead = [(ahead, list(range(len(ahead.mm_inputs))))]
    memory.reset_peak()
    step = runner.execute(out)
    Sampler(config.seed, max_num_seqs=config.max_num_seqs).sample(step.logits, verify_rows(step.sampling))
    if speculator is not None:
        items = [DraftFrom(s.request, 1, i, s.request.num_computed_tokens, speculator.num_tokens)
                 for i, s in enumerate(step.sampling)]
        speculator.propose(items, runner.block_tables, runner.kv_caches, config.block_size, hidden=step.hidden)
    activations = memory.peak_allocated() - weights - held
    checks = list(runner.backend_checks)
    del runner, step, kv
    memory.release()
    overhead = {}
    for t, p in pools.items():   # each pool larger in turn: what a block costs a runner beyond its K/V
        runner, bigger, held_t = runner_bytes(t)
        del runner
        memory.release()
        added = bigger[t].num_blocks - p.num_blocks
        overhead[t] = max(0, round((held_t - held) / added) - p.bytes_per_block)
    fixed = held - sum(p.num_blocks * (p.bytes_per_block + overhead[t]) for t, p in pools.items())
    now = memory.snapshot()
    profile = MemoryProfile(total=now.total, utilization=config.gpu_memory_utilization, weights=weights,
                            runner_fixed=max(0, fixed), activations=max(0, activations),
                            outside_torch=max(0, now.outside_torch - baseline.outside_torch),
                            block_overhead=overhead)
    logger.info("memory profile: %s", profile.describe())
    return profile, checks


def device_baseline(config: EngineConfig, device: torch.device) -> tuple[DeviceMemory | None, MemorySnapshot | None]:
    """The reader of the device whose memory sizes the KV cache, and its figures now (before the
    model loads); (None, None) when the size is given, or the device has no reader (a CPU)."""
    if config.num_kv_blocks or config.kv_cache_bytes:
        return None, None
    memory = device_memory(device)
    if memory is None:
        return None, None
    if config.tensor_parallel_size > 1:
        raise ValueError("--gpu-memory-utilization is not profiled under tensor parallelism yet: give each rank's "
                         "KV cache with --kv-cache-bytes")
    return memory, memory.snapshot()


def size_kv_cache(model, config: EngineConfig, kv_specs: dict, *, max_model_len: int, speculator=None,
                  memory: DeviceMemory | None = None, baseline: MemorySnapshot | None = None):
    """The KV plan: `--num-kv-blocks` blocks per pool, or `--kv-cache-bytes`, or what the device's
    memory leaves (`profile_memory`), or a CPU's default. Returns (plan, what sized it, the profiling
    runner's backend checks: empty without a profile)."""
    spec = model.spec
    kv_bytes, overhead, checks = config.kv_cache_bytes, None, []
    if config.num_kv_blocks:
        sized_by = f"--num-kv-blocks {config.num_kv_blocks}"
    elif kv_bytes:
        sized_by = "--kv-cache-bytes"
    elif memory is not None:
        profile, checks = profile_memory(model, config, max_model_len=max_model_len, memory=memory,
                                         baseline=baseline, speculator=speculator)
        kv_bytes, overhead, sized_by = profile.kv_cache_bytes, profile.block_overhead, profile.describe()
        if kv_bytes <= 0:
            raise KVCacheTooSmall(f"no room for a KV cache: {sized_by}; raise --gpu-memory-utilization or "
                                  f"lower --max-num-batched-tokens / --prefill-batched-tokens / --max-num-seqs")
    else:
        kv_bytes, sized_by = CPU_KV_CACHE_BYTES, f"a CPU's default {CPU_KV_CACHE_BYTES // 2**20} MiB"
    plan = plan_pools(spec.kv_layer_types, kv_specs, block_size=config.block_size, dtype_bytes=model.dtype.itemsize,
                      num_kv_blocks=config.num_kv_blocks, kv_cache_bytes=kv_bytes, max_num_seqs=config.max_num_seqs,
                      max_step_tokens=config.max_step_tokens, max_model_len=max_model_len,
                      num_speculative_tokens=speculator.num_tokens if speculator else 0, block_overhead=overhead,
                      window_cache_share=config.window_cache_share if config.enable_prefix_caching else 0.0)
    logger.info("%s (sized by %s)", plan.describe(config.block_size, max_model_len), sized_by)
    return plan, sized_by, checks
