"""--gpu-memory-utilization's start-up path on this CPU: the engine core, given a device of a made-up
size (what torch allocates here counts as the device's, read from the live tensors), runs the
largest step its configuration allows, sizes the KV cache with what the budget leaves, reports it,
and refuses a budget that cannot hold one request of the full context, naming the numbers."""

from __future__ import annotations

import gc
import itertools
import random
import weakref

import pytest
import torch
from engine_helpers import build_request

from mmserve.config import EngineConfig
from mmserve.core.engine_core import EngineCore
from mmserve.core.kv_cache.planner import KVCacheTooSmall
from mmserve.request import Request
from mmserve.sample.sampler import Sampler
from mmserve.sampling_params import SamplingParams
from mmserve.worker import memory_profile
from mmserve.worker.memory_profile import MemorySnapshot
from mmserve.worker.model_runner import ModelRunner

MiB = 2**20


# Weak references to the tensors alive when the fake device was installed (the model's weights among
# them), whose objects gc.freeze() then set aside: every gc.collect() and heap walk the profile makes
# (~40 a test) then skips the interpreter's whole start-up heap (torch, transformers: ~0.4 s each).
_frozen_tensors: list[weakref.ref] = []


def live_tensor_bytes() -> int:
    """Bytes of every live CPU tensor's storage, each storage once (garbage collected first, as the
    profile does; fake tensors other tests left behind have none): the tensors set aside by
    gc.freeze() that are still alive, and those the collector tracks."""
    gc.collect()
    seen, total = set(), 0
    frozen = [t for ref in _frozen_tensors if (t := ref()) is not None]
    for obj in itertools.chain(frozen, gc.get_objects()):
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu" and obj.layout == torch.strided:
            try:
                storage = obj.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError):
                continue
            if ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
    return total


@pytest.fixture
def frozen_heap():
    """gc.freeze() the heap as the test starts (after a collection), remembering its tensors by weak
    reference so live_tensor_bytes still counts them; unfrozen afterwards."""
    gc.collect()
    _frozen_tensors[:] = [weakref.ref(o) for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    gc.freeze()
    yield
    gc.unfreeze()
    _frozen_tensors.clear()


class FakeDevice:
    """A device of `total` bytes with `free` of them free at start-up; torch's live tensors are its
    allocations; a step's peak is what was live at `reset_peak` plus `activations`."""

    def __init__(self, total: int, free: int, activations: int):
        self.total, self.free, self.activations = total, free, activations
        self.events: list[str] = []
        self._at_reset = 0

    def snapshot(self) -> MemorySnapshot:
        allocated = live_tensor_bytes()
        return MemorySnapshot(self.free - allocated, self.total, allocated, allocated)

    def reset_peak(self) -> None:
        self.events.append("reset_peak")
        self._at_reset = live_tensor_bytes()

    def peak_allocated(self) -> int:
        self.events.append("peak")
        return self._at_reset + self.activations

    def release(self) -> None:
        gc.collect()


@pytest.fixture
def on_fake_device(monkeypatch, frozen_heap):
    """Make the CPU a device of the given size; record each profile and every step the runners execute."""
    seen = {"profiles": [], "steps": [], "device": None}
    real_profile, real_execute = memory_profile.profile_memory, ModelRunner.execute

    def profile(*args, **kw):
        result = real_profile(*args, **kw)
        seen["profiles"].append(result[0])
        return result

    def execute(self, out):   # a summary: holding the step would keep its pixels alive, counted as the device's
        first = out.scheduled[0].request
        seen["steps"].append(dict(tokens=out.num_batched_tokens, requests=len(out.scheduled),
                                  images=[e - s + 1 for s, e in first.mm_ranges],
                                  sampling=[s.seq_len == s.request.num_tokens for s in out.scheduled]))
        if seen["device"] is not None:
            seen["device"].events.append("execute")
        return real_execute(self, out)

    monkeypatch.setattr(memory_profile, "profile_memory", profile)
    monkeypatch.setattr(ModelRunner, "execute", execute)

    def install(total: int, free: int, activations: int) -> FakeDevice:
        seen["device"] = FakeDevice(total, free, activations)
        monkeypatch.setattr(memory_profile, "device_memory", lambda device: seen["device"])
        return seen["device"]

    return install, seen


OPTIONS = dict(device="cpu", attention_backend="sdpa", block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
               prefill_batched_tokens=128, backend_self_check="off")


def test_the_kv_cache_gets_what_the_budget_leaves_after_the_largest_step(load_backend, on_fake_device):
    model, tok = load_backend("sdpa")
    install, seen = on_fake_device
    weights = live_tensor_bytes()
    # half of the device: the weights, 3 MiB of activations and about 1.5 MiB of KV cache
    device = install(total=2 * (weights + 5 * MiB), free=2 * (weights + 5 * MiB), activations=3 * MiB)
    core = EngineCore(EngineConfig(gpu_memory_utilization=0.5, **OPTIONS), model=model, tokenizer=tok)
    [profile] = seen["profiles"]
    # the largest step: both budgets' larger one, every seat sampling, the first request's images filling it
    step = seen["steps"][0]
    assert step["tokens"] == 128 and step["requests"] == 4 and step["sampling"] == [True] * 4
    largest = max(step["images"])   # the largest image admission allows (<= 64 tokens), as many as fit
    assert 48 < largest <= 64 and len(step["images"]) == (128 - 3 - 1) // (largest + 2)
    assert device.events[:3] == ["reset_peak", "execute", "peak"]
    # the arithmetic, from the device's figures
    assert profile.budget == int(device.total * 0.5) and profile.activations == 3 * MiB
    assert abs(profile.weights - weights) < MiB
    assert profile.kv_cache_bytes == (profile.budget - profile.weights - profile.runner_fixed - 3 * MiB
                                      - profile.outside_torch)
    kv = core.kv_capacity
    cheapest = min(p.bytes_per_block for p in core.kv.plans.values())
    assert profile.kv_cache_bytes - cheapest * len(core.kv.plans) < kv.num_bytes <= profile.kv_cache_bytes
    assert kv.full_context_requests >= 1 and "--gpu-memory-utilization 0.5" in kv.sized_by
    # and it serves
    from mmserve.ipc.protocol import EngineCoreRequest

    req = build_request("r", [5, ("image", 9), 20], 3, max_tokens=3)
    core.add_request(EngineCoreRequest(req.request_id, req.prompt_token_ids, req.mm_ranges, req.mm_inputs, req.sampling))
    while core.has_work:
        core.step()


def test_a_budget_that_cannot_hold_one_full_context_request_is_refused_naming_the_numbers(load_backend,
                                                                                         on_fake_device):
    model, tok = load_backend("sdpa")
    install, seen = on_fake_device
    weights = live_tensor_bytes()
    # what a runner holds beside its pools, from a profile on a roomy device
    install(total=2 * (weights + 5 * MiB), free=2 * (weights + 5 * MiB), activations=MiB)
    EngineCore(EngineConfig(gpu_memory_utilization=0.5, **OPTIONS), model=model, tokenizer=tok)
    [roomy] = seen["profiles"]
    gc.collect()
    # half of the device: the weights, the runner's buffers, 1 MiB of activations and about 300 kB,
    # a part of one full context
    budget = weights + roomy.runner_fixed + roomy.outside_torch + MiB + 300_000
    install(total=2 * budget, free=2 * budget, activations=MiB)
    with pytest.raises(KVCacheTooSmall) as info:
        EngineCore(EngineConfig(gpu_memory_utilization=0.5, **OPTIONS), model=model, tokenizer=tok)
    text = str(info.value)
    del info   # its traceback holds the profiling runner's tensors, which would count as the device's
    assert "at most " in text, text
    fits = int(text.rsplit("at most ", 1)[1])
    assert f"({model.spec.max_model_len} tokens)" in text and "MiB" in text and 0 < fits < model.spec.max_model_len
    core = EngineCore(EngineConfig(gpu_memory_utilization=0.5, max_model_len=fits, **OPTIONS), model=model, tokenizer=tok)
    assert core.kv_capacity.full_context_requests >= 1   # the context it named fits


def test_utilization_above_what_is_free_at_start_up_is_refused(load_backend, on_fake_device):
    model, tok = load_backend("sdpa")
    install, _ = on_fake_device
    install(total=8 * 2**30, free=2**30, activations=MiB)
    with pytest.raises(ValueError, match="were free at start-up"):
        EngineCore(EngineConfig(gpu_memory_utilization=0.9, **OPTIONS), model=model, tokenizer=tok)


def test_a_given_size_skips_the_profile_and_a_cpu_keeps_its_default(load_backend, on_fake_device):
    model, tok = load_backend("sdpa")
    _, seen = on_fake_device
    core = EngineCore(EngineConfig(**OPTIONS), model=model, tokenizer=tok)   # no device reader: the CPU default
    assert not seen["profiles"] and core.kv_capacity.sized_by == "a CPU's default 256 MiB"
    core = EngineCore(EngineConfig(kv_cache_bytes=8 * MiB, **OPTIONS), model=model, tokenizer=tok)
    assert not seen["profiles"] and core.kv_capacity.sized_by == "--kv-cache-bytes" and core.kv_capacity.num_bytes <= 8 * MiB


def test_the_profiling_step_drafts_for_every_request_with_a_speculative_model(tmp_path, on_fake_device, monkeypatch):
    from gemma4_fixtures import make_assistant, make_checkpoint, tiny_config

    from mmserve.model import load_model
    from mmserve.spec_decode.speculator import Speculator

    cfg = tiny_config(window=6)
    make_assistant(tmp_path / "assistant", cfg, seed=33, copy_from=make_checkpoint(tmp_path / "target", config=cfg, seed=31))
    model = load_model(tmp_path / "target", attention_backend="sdpa")
    install, _ = on_fake_device
    device = install(total=2 * (live_tensor_bytes() + 8 * MiB), free=2 * (live_tensor_bytes() + 8 * MiB),
                     activations=MiB)
    drafted, propose = [], Speculator.propose

    def recording(self, items, *args, **kw):
        device.events.append("propose")
        drafted.append([(i.num_keys, i.num_drafts) for i in items])
        return propose(self, items, *args, **kw)

    monkeypatch.setattr(Speculator, "propose", recording)
    EngineCore(EngineConfig(gpu_memory_utilization=0.5, speculative_model=str(tmp_path / "assistant"),
                            num_speculative_tokens=3, **OPTIONS), model=model)
    assert device.events[:4] == ["reset_peak", "execute", "propose", "peak"]
    assert len(drafted[0]) == 4 and all(n == 3 for _, n in drafted[0]) and drafted[0][0][0] == 128 - 3


def test_batching_defaults_follow_the_device_and_graphs_cover_them(monkeypatch):
    from mmserve.worker.cuda_graphs import capture_sizes

    cpu, cuda = EngineConfig(device="cpu"), EngineConfig(device="cuda:0")
    assert (cpu.max_num_batched_tokens, cpu.prefill_batched_tokens, cpu.max_num_seqs, cpu.kv_cache_bytes) == (512, 2048, 64, 0)
    assert (cuda.max_num_batched_tokens, cuda.prefill_batched_tokens, cuda.max_num_seqs) == (2048, 8192, 128)
    assert capture_sizes(cuda.max_num_seqs)[-1] == 128 and cuda.max_step_tokens == 8192
    given = EngineConfig(device="cuda", max_num_seqs=8, max_num_batched_tokens=256, prefill_batched_tokens=0)
    assert (given.max_num_batched_tokens, given.prefill_batched_tokens, given.max_num_seqs) == (256, 0, 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineConfig().max_num_seqs == 128   # --device auto on a machine with CUDA


def peak_cpu_bytes(fn) -> int:
    """The most bytes `fn` held allocated at once on the CPU: torch.profiler's allocation and free
    events, summed in time order (each allocation is the self memory of the op that made it)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    held = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak


def random_sampling(rng: random.Random, vocab: int) -> SamplingParams:
    """Any mix of what a request may ask of the sampler."""
    kw = {}
    if rng.random() < 0.7:
        kw.update(temperature=rng.uniform(0.5, 1.5))
        if rng.random() < 0.5:
            kw.update(top_k=rng.randrange(1, 100))
        if rng.random() < 0.5:
            kw.update(top_p=rng.uniform(0.5, 0.99))
        if rng.random() < 0.5:
            kw.update(seed=rng.randrange(2**31))
    if rng.random() < 0.5:
        kw.update(logprobs=True, top_logprobs=rng.randrange(0, 21))
    if rng.random() < 0.5:
        kw.update(repetition_penalty=rng.uniform(1.1, 2.0), frequency_penalty=rng.uniform(-1, 1))
    if rng.random() < 0.3:
        kw.update(logit_bias=tuple((rng.randrange(vocab), rng.uniform(-5, 5)) for _ in range(rng.randrange(1, 8))))
    if rng.random() < 0.3:
        kw.update(min_tokens=rng.randrange(0, 8), max_tokens=8)
    return SamplingParams(**kw)


def test_the_profiling_step_samples_the_way_that_holds_the_most_memory(load_backend):
    """The profile's sampling (its requests' parameters, a fresh sampler: the penalty tables too)
    holds at least what any mix of sampling options holds for as many rows, measured as the CPU
    allocator's peak: the KV cache is sized with what is left, so a step of logprobs, penalised or
    seeded rows must not need more than the profile saw. The largest request asks for its prompt's
    logprobs too (their logits: up to 512 rows x the vocabulary)."""
    model, _ = load_backend("sdpa")
    rows, vocab = 16, 8192
    config = EngineConfig(**{**OPTIONS, "max_num_seqs": rows, "max_num_batched_tokens": 256})
    profiled = memory_profile.profiling_requests(model.spec, config, max_model_len=512)
    assert len(profiled) == rows and profiled[0].sampling_params.prompt_logprobs
    logits = torch.randn(rows, vocab) * 3
    rng = random.Random(random.getrandbits(64))

    def peak(params: list[SamplingParams]) -> int:
        requests = [Request(f"r{i}", [rng.randrange(vocab) for _ in range(30)], p,
                            output_token_ids=[rng.randrange(vocab) for _ in range(5)]) for i, p in enumerate(params)]
        return peak_cpu_bytes(lambda: Sampler(eos_token_ids=[1], max_num_seqs=rows).sample(logits, requests))

    profile_peak = peak([r.sampling_params for r in profiled])
    for _ in range(4):
        mix = [random_sampling(rng, vocab) for _ in range(rows)]
        assert peak(mix) <= profile_peak, mix
