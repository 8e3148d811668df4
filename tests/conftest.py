"""Shared fixtures: real PyAV-encoded videos and a real mmserve server on 127.0.0.1:0.

`mmserve_server` serves $MMSERVE_TEST_MODEL, else the embedded demo model when it is present
(src/mmserve/demo_model/), else a tiny random Gemma 4 checkpoint; it runs the real AsyncEngine in a background thread with
its own event loop, once per test session. The `start_server` fixture starts one with other options.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import logging
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

# Inductor checks each vector ISA the CPU reports (cpuid) by compiling a probe against ATen's vector
# headers and loading it in a fresh Python, in every process that compiles: ~1.1 s of CPU per test
# worker, server and bench script, and ~10 s of g++ once on an empty compile cache. Here the probes
# pass and pick the ISA the flags alone pick (avx512 + vnni + amx on the CI Xeon); a compiler that
# could not build for it fails the compiling tests loudly. Inherited by the processes tests start.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from loopback_server import LoopbackServer, engine_config  # noqa: E402

from mmserve.config import DEMO_MODEL_DIR, ServerConfig  # noqa: E402

TESTS = Path(__file__).parent
FA4_COMPILE_TESTS = "tests/attention/test_attn_fa4_compile.py"
_fa4_outcomes: dict[str, str] = {}

# One torch thread in each test process: `make test` runs two pytest workers on two cores, where two
# OpenMP teams of two spin against each other (a speculative engine test took 38 s, with one thread
# 1 s). Servers the tests start are other processes and keep their configured threads.
torch.set_num_threads(1)


# Random draws. Each test runs with torch's, numpy's and `random`'s global generators seeded from (the
# salt, its node id), and the module and class fixtures set up for it from (the salt, its file): what a
# test draws no longer depends on which tests ran before it in its process, and one salt reproduces it.
# MMSERVE_TEST_SEED=N picks another salt (other draws); a failing test's report names its salt.
DEFAULT_SEED_SALT = 0


def _seed_salt() -> int:
    value = os.environ.get("MMSERVE_TEST_SEED", str(DEFAULT_SEED_SALT))
    try:
        return int(value)
    except ValueError:
        raise pytest.UsageError(f"MMSERVE_TEST_SEED must be an integer, got {value[:40]!r}") from None


SEED_SALT = _seed_salt()
SEED_LINE = f"random seeds: salt {SEED_SALT}, each test's draws from (salt, node id); MMSERVE_TEST_SEED=N for others"


def _seed_generators(key: str) -> None:
    """~15 us; torch.manual_seed would spend ~170 us queueing seeds for CUDA and XPU devices never started."""
    digest = hashlib.blake2b(f"{SEED_SALT}:{key}".encode(), digest_size=8).digest()
    seed = int.from_bytes(digest, "little")
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
    np.random.seed(seed >> 32)
    random.seed(seed)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture: a module fixture draws the same whichever of the file's tests sets it up."""
    _seed_generators(item.nodeid.split("::")[0])


@pytest.fixture(autouse=True)
def _seeded_draws(request):
    """After the module's fixtures (set up for the first test that needs them): a test run alone draws as in a full run."""
    _seed_generators(request.node.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        report.sections.append(("random seeds", f"salt {SEED_SALT}; the same draws again: "
                                                f"MMSERVE_TEST_SEED={SEED_SALT} pytest '{item.nodeid}'"))
    return report


# The engine loop. Every engine the suite builds (in-process, the servers and TP ranks it starts)
# takes its --async-scheduling default from MMSERVE_ASYNC_SCHEDULING (config.py): unset, auto, which is
# the synchronous loop on this CPU; MMSERVE_ASYNC_SCHEDULING=on runs the suite on the loop CUDA users
# run. Tests about one loop name it.
ENGINE_LOOP = os.environ.get("MMSERVE_ASYNC_SCHEDULING", "auto")
LOOP_LINE = (f"engine loop: {dict(on='async', off='synchronous').get(ENGINE_LOOP, 'auto (synchronous on a CPU)')} "
             f"unless a test names one (MMSERVE_ASYNC_SCHEDULING={ENGINE_LOOP}); =on for the async loop")


def pytest_report_header(config):
    return [SEED_LINE, LOOP_LINE]


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """A command's main() run in-process (cli.main, `mmserve demo`, `mmserve perf`) points root logging
    at that test's captured stderr (logs.configure_logging); a later test's server thread then logged
    into the closed stream ("--- Logging error ---", and a progress-bar test reading stderr failed).
    Remove what a test added (plain StreamHandlers only: pytest's own are subclasses) and its level."""
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    yield
    for handler in [h for h in root.handlers if type(h) is logging.StreamHandler and h not in before]:
        root.removeHandler(handler)
    root.setLevel(level)


# The longest modules first. `make test` runs `--dist loadfile`: each module whole on one worker, the
# modules handed out in collection order, so a long one collected late (tests/reliability/ sorts
# after most folders) still runs while the other worker has nothing left. Ordered by their time in a
# full run (docs/benchmarks.md, suite time); the rest keep pytest's order.
LONGEST_MODULES = ("tests/bench/test_bench_smoke.py", "tests/reliability/test_rel_tensor_parallel.py",
                   "tests/attention/test_attn_fa4_compile.py", "tests/engine/test_engine_tensor_parallel_async.py",
                   "tests/metrics/test_prometheus_e2e.py", "tests/gateway/test_gateway_routing.py")


def pytest_collection_modifyitems(config, items):
    first = {module: i for i, module in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))   # stable: the rest in order


def pytest_runtest_logreport(report):
    """Remember how the FA4 compile check (no GPU needed) went; its numerics test (marked gpu) may skip."""
    if report.nodeid.startswith(FA4_COMPILE_TESTS) and "gpu" not in report.keywords:
        if report.when == "call" or report.outcome != "passed":
            _fa4_outcomes[report.nodeid] = report.outcome


def _fa4_check_required_but_not_passed() -> bool:
    return os.environ.get("MMSERVE_REQUIRE_FA4_CHECK") == "1" and (
        not _fa4_outcomes or set(_fa4_outcomes.values()) != {"passed"})


def pytest_sessionfinish(session, exitstatus):
    """Under MMSERVE_REQUIRE_FA4_CHECK=1 (CI) the FA4 compile tests must all have run and passed.
    Judged where every report arrives: the only process, or the controller of pytest-xdist workers."""
    if hasattr(session.config, "workerinput"):
        return
    if exitstatus == 0 and _fa4_check_required_but_not_passed():
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say in the log whether the FA4 FakeTensorMode compile tests ran (CI's log must show they did)."""
    ran = ", ".join(f"{nodeid.split('::')[-1]} {outcome}" for nodeid, outcome in sorted(_fa4_outcomes.items()))
    terminalreporter.write_line(f"FA4 compile check (FakeTensorMode, no GPU): {ran or 'not run'}")
    if config.option.verbose < 0:   # -q (`make test`) prints no header
        terminalreporter.write_line(SEED_LINE)
        terminalreporter.write_line(LOOP_LINE)
    if _fa4_check_required_but_not_passed():
        terminalreporter.write_line("MMSERVE_REQUIRE_FA4_CHECK=1: the FA4 compile tests must run and pass", red=True)


def _make_video(seed: int = 0, *, num_frames: int = 8, size: int = 32, fps: float = 4.0,
               container: str = "mp4") -> bytes:
    """A real encoded clip (PyAV) of a coloured shape moving; same seed, same bytes."""
    from mmserve.multimodal.synthetic import make_clip

    return make_clip(seed, size=size, num_frames=num_frames, fps=fps, container=container).data


@pytest.fixture(scope="session", autouse=True)
def peaks_cache(tmp_path_factory):
    """One device-peak calibration per test session, in a file of its own (never the user's cache);
    servers started as subprocesses inherit it through the environment."""
    path = tmp_path_factory.mktemp("peaks") / "peaks.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MMSERVE_PEAKS_CACHE", str(path))
        yield path


@pytest.fixture(scope="session", autouse=True)
def forked_engines():
    """Engine processes forked from one preloaded forkserver per test process (engine_forkserver.py)."""
    from engine_forkserver import forked_engines_module

    from mmserve.engine import core_client

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(core_client, "multiprocessing", forked_engines_module())
        yield


@pytest.fixture
def spawned_engines(monkeypatch):
    """For a test of the engine process's start itself: engines spawned as `mmserve serve` spawns them."""
    import multiprocessing

    from mmserve.engine import core_client

    monkeypatch.setattr(core_client, "multiprocessing", multiprocessing)


@pytest.fixture(scope="session")
def make_video():
    """The clip factory: `make_video(seed, num_frames=8, size=32, fps=4.0, container="mp4") -> bytes`."""
    return _make_video


@pytest.fixture(scope="session")
def video_bytes() -> bytes:
    return _make_video(0)


@dataclass(frozen=True)
class BigVideo:
    """A ~200 MB lossless mp4 (`path`) whose 4 sampled frames are those of the small `twin` (same
    pixels, same timestamps 0/17/34/51 s): asking about either must give the same answer."""

    path: Path
    twin: bytes
    num_frames: int = 4


@pytest.fixture(scope="session")
def big_video(tmp_path_factory) -> BigVideo:
    """Made once per session (about 10 s): noise between the content frames, 25 fps, a keyframe
    every 2 s as phones write them; the twin has black frames between them at 1 fps."""
    from media_clips import content_frames, noise, write_padded

    folder = tmp_path_factory.mktemp("big_video")
    content = content_frames(seed=7, count=4, size=256)
    path = write_padded(folder / "big.mp4", content, spacing=425, fps=25, filler=noise(256), keyframe_interval=50)
    twin = write_padded(folder / "twin.mp4", content, spacing=17, fps=1,
                        filler=itertools.repeat(np.zeros((256, 256, 3), dtype=np.uint8)))
    return BigVideo(path, twin.read_bytes())


def _gemma4_fixtures():
    """tests/model/gemma4_fixtures.py, importable from any test directory."""
    if "gemma4_fixtures" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gemma4_fixtures", TESTS / "model" / "gemma4_fixtures.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["gemma4_fixtures"] = module
        spec.loader.exec_module(module)
    return sys.modules["gemma4_fixtures"]


@pytest.fixture(scope="session")
def gemma4_fixtures():
    """The tiny-checkpoint builders of tests/model/gemma4_fixtures.py (configs of every variant)."""
    return _gemma4_fixtures()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Gemma 4 checkpoint (text + vision, sliding and full layers)."""
    path = tmp_path_factory.mktemp("tiny_gemma4")
    _gemma4_fixtures().make_checkpoint(path, seed=0)
    return path


@pytest.fixture(scope="session")
def served_model(request) -> Path:
    """$MMSERVE_TEST_MODEL if set, else the embedded demo model when it has landed, else a tiny
    random checkpoint."""
    if given := os.environ.get("MMSERVE_TEST_MODEL"):
        return Path(given)
    if (DEMO_MODEL_DIR / "config.json").exists():
        return DEMO_MODEL_DIR
    return request.getfixturevalue("tiny_checkpoint")


def _start_server(model: Path, *, server_overrides: dict | None = None, **engine_overrides) -> LoopbackServer:
    server_config = ServerConfig(host="127.0.0.1", port=0, worker_threads=2, drain_grace_s=5.0,
                                 **(server_overrides or {}))
    return LoopbackServer(engine_config(model, **engine_overrides), server_config).start()


@pytest.fixture(scope="session")
def mmserve_server(served_model) -> LoopbackServer:
    server = _start_server(served_model)
    yield server
    server.stop()


@pytest.fixture
def start_server():
    """Factory for a server with other options: `start_server(model, server_overrides={...}, **engine_options)`;
    every server it starts is stopped after the test."""
    started: list[LoopbackServer] = []

    def start(model: Path, **kwargs) -> LoopbackServer:
        started.append(_start_server(model, **kwargs))
        return started[-1]

    yield start
    for server in started:
        server.stop()
