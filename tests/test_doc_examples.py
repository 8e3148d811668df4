"""Every shell and Python example of README.md and the docs runs as written against a real server
(the session's demo-model server), in a directory holding the files they name.

Only what cannot run on this machine is adapted or left out: the address (the examples say
127.0.0.1:50051, the test server has an ephemeral port; `mmserve` subcommands that rely on the
default `--server` get it), `.venv/bin/` (the test's interpreter runs `mmserve`), `make demo`
(it is `mmserve demo`), and blocks that start servers, clusters or containers (`make run`,
`make test`, `make prometheus`, `mmserve serve`, `smg launch`, `docker`, `kubectl`), which the suite covers elsewhere
(tests/test_cli.py checks `make run`'s command, tests/deploy the manifests, tests/gateway SMG):
of those blocks the client commands (`mmserve generate|upload|demo`, as docs/deploy.md's) still run.
docs/gateway.md's OpenAI example runs against a real SMG in front of the session's server, its KV
events subscriber against a server publishing them over ZMQ (on ipc endpoints in a private
directory instead of the doc's TCP ports), docs/api.md's audio examples (the blocks naming
speech.wav or talk.mp4) against a tiny random E-model (the demo model has no audio tower). Blocks
that need what only a deployment has (docs/security.md's certificates and keys: its grpcurl command
runs in tests/reliability/test_rel_tls.py, against that module's server over mutual TLS) and
diagrams (no line starting with a command) are not examples here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from mmserve.multimodal.synthetic import make_clip

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/api.md", "docs/deploy.md", "docs/operations.md", "docs/tracing.md", "docs/gateway.md",
        "docs/security.md")
NEEDS_A_DEPLOYMENT = {"docs/security.md"}   # certificates, API keys: tests/reliability/test_rel_tls.py (its grpcurl), _auth.py
DEFAULT_ADDRESS = "127.0.0.1:50051"
GATEWAY_URL = "http://127.0.0.1:8000/v1"
KV_EVENTS = ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")   # the docs' ZMQ publisher and its replay socket
AUDIO_FILES = ("speech.wav", "talk.mp4")   # the audio examples' files: they need a model with an audio tower
NOT_HERE = re.compile(r"^\s*(\S+=\S+ )*(make (?!demo\b)|docker |kubectl |(?:\.venv/bin/)?(?:mmserve serve\b|smg ))", re.M)
CLIENT_LINE = re.compile(r"^\s*(?:\.venv/bin/)?mmserve (?:generate|upload|demo)\b.*$", re.M)
COMMAND = re.compile(r"^\s*(?:\.venv/bin/)?(?:mmserve|grpcurl|make|docker|kubectl) ", re.M)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _blocks(lang: str):
    """(doc, line, block) of each example in `lang` ("sh": bash/sh fences and unlabelled ones whose
    lines start with a command)."""
    for doc in DOCS:
        if doc in NEEDS_A_DEPLOYMENT:
            continue
        text = (ROOT / doc).read_text()
        for m in FENCE.finditer(text):
            tag, block = m.group(1), m.group(2)
            shell = tag in ("bash", "sh") or (tag == "" and COMMAND.search(block))
            if tag == lang or (lang == "sh" and shell):
                yield doc, text.count("\n", 0, m.start()) + 1, block


def examples(lang: str, *, gateway: bool = False, kv_events: bool = False, audio: bool = False) -> list[pytest.param]:
    """Runnable examples; of a block that starts servers or clusters, its client lines only.
    `gateway`: the examples that talk to an OpenAI gateway (GATEWAY_URL); `kv_events`: those that
    subscribe to KV events over ZMQ (KV_EVENTS); `audio`: those that send audio (AUDIO_FILES); else
    the others."""
    found = []
    for doc, line, block in _blocks(lang):
        if NOT_HERE.search(block):
            block = "\n".join(m.group(0) for m in CLIENT_LINE.finditer(block))
        subscribes = any(endpoint in block for endpoint in KV_EVENTS)
        hears = any(name in block for name in AUDIO_FILES)
        if block.strip() and (GATEWAY_URL in block) == gateway and subscribes == kv_events and hears == audio:
            found.append(pytest.param(block, id=f"{doc}:{line}"))
    return found


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The files the examples name: clip.mp4, meeting.mp4 (longer), cat.png, schema.json, speech.wav
    (2 s of tones) and talk.mp4 (a clip with a soundtrack)."""
    from audio_clips import av_clip, tones, wav

    path = tmp_path_factory.mktemp("docs")
    (path / "clip.mp4").write_bytes(make_clip(7).data)
    (path / "speech.wav").write_bytes(wav(tones(7, 2.0)))
    (path / "talk.mp4").write_bytes(av_clip(make_clip(9, num_frames=8).frames, 4, tones(9, 2.0), fmt="mp4"))
    (path / "meeting.mp4").write_bytes(make_clip(8, num_frames=64, fps=2).data)
    Image.new("RGB", (48, 32), (200, 40, 40)).save(path / "cat.png")
    (path / "schema.json").write_text('{"type": "object", "properties": {"ok": {"type": "boolean"}}, '
                                      '"required": ["ok"], "additionalProperties": false}')
    return path


def adapted_shell(block: str, address: str) -> str:
    block = block.replace(".venv/bin/", "").replace("make demo", "mmserve demo").replace(DEFAULT_ADDRESS, address)
    return re.sub(r"\bmmserve (generate|demo|upload)(?![\w-])(?![^\n]*--server)", rf"mmserve \1 --server {address}",
                  block)


def test_the_docs_have_examples():
    assert len(examples("sh")) >= 6 and len(examples("python")) >= 2 and examples("python", gateway=True)
    assert examples("python", kv_events=True) and examples("sh", audio=True) and examples("python", audio=True)
    ran = {p.id.split(":")[0] for kind in ("sh", "python") for p in examples(kind) + examples(kind, gateway=True)}
    assert {"README.md", "docs/api.md", "docs/deploy.md", "docs/gateway.md"} <= ran


def run_shell(block: str, address: str, workdir: Path) -> None:
    grpcurl = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    prelude = (f'mmserve() {{ "{sys.executable}" -m mmserve.cli "$@"; }}\n'
               f'grpcurl() {{ "{grpcurl}" "$@"; }}\nset -e -o pipefail\n')
    out = subprocess.run(["bash", "-c", prelude + adapted_shell(block, address)], cwd=workdir,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert out.returncode == 0, f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


def run_python(block: str, address: str, workdir: Path) -> None:
    code = block.replace(DEFAULT_ADDRESS, address)
    out = subprocess.run([sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


@pytest.mark.parametrize("block", examples("sh"))
def test_shell_example_runs(block, mmserve_server, workdir):
    run_shell(block, mmserve_server.address, workdir)


@pytest.mark.parametrize("block", examples("python"))
def test_python_example_runs(block, mmserve_server, workdir):
    run_python(block, mmserve_server.address, workdir)


@pytest.fixture(scope="module")
def audio_server(tmp_path_factory, gemma4_fixtures):
    """A tiny random E-model (an audio tower) for the audio examples, its engine core on a thread of
    this process (cheap to start)."""
    from loopback_server import LoopbackServer, engine_config

    from mmserve.config import ServerConfig

    model = tmp_path_factory.mktemp("doc-e-model")
    gemma4_fixtures.make_checkpoint(model, config=gemma4_fixtures.e_model_config(), seed=7)
    server = LoopbackServer(engine_config(model, default_num_frames=2, engine_process=False),
                            ServerConfig(host="127.0.0.1", port=0, worker_threads=2)).start()
    yield server
    server.stop()


@pytest.mark.parametrize("block", examples("sh", audio=True))
def test_audio_shell_example_runs(block, audio_server, workdir):
    run_shell(block, audio_server.address, workdir)


@pytest.mark.parametrize("block", examples("python", audio=True))
def test_audio_python_example_runs(block, audio_server, workdir):
    run_python(block, audio_server.address, workdir)


@pytest.fixture(scope="module")
def gateway(mmserve_server):
    """A real SMG (OpenAI HTTP) in front of the session's server, as docs/gateway.md starts it."""
    sys.path.insert(0, str(ROOT / "tests" / "gateway"))
    from smg_harness import DeadPort, Smg

    dead = DeadPort()   # the Hub lookup SMG makes points at a refusing loopback port
    smg = Smg([f"grpc://{mmserve_server.address}"], policy="cache_aware", hf_endpoint=dead.url,
              extra=("--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0"))
    try:
        smg.wait_ready(time.monotonic() + 180, 1)
        yield smg
    finally:
        smg.stop()
        dead.close()


@pytest.mark.parametrize("block", examples("python", gateway=True))
def test_gateway_example_runs(block, gateway, workdir):
    code = block.replace(GATEWAY_URL, gateway.base_url + "/v1")
    out = subprocess.run([sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


@pytest.fixture(scope="module")
def kv_events_server(served_model, tmp_path_factory):
    """A server publishing KV events over ZMQ as docs/gateway.md starts one, on ipc endpoints; it has
    served one request, so its snapshot holds blocks. Returns (server, the endpoints, in KV_EVENTS' order)."""
    import json

    from loopback_server import LoopbackServer, engine_config

    from mmserve.clients import Client
    from mmserve.config import ServerConfig

    d = tmp_path_factory.mktemp("kv-events")
    endpoints = (f"ipc://{d}/pub", f"ipc://{d}/replay")
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoints[0],
                         "replay_endpoint": endpoints[1], "topic": "kv@pod-0@demo_model"})
    server = LoopbackServer(engine_config(served_model), ServerConfig(host="127.0.0.1", port=0, worker_threads=2,
                                                                      kv_events_config=config)).start()
    try:
        with Client(server.address) as client:
            client.generate(prompt="Count the red squares in the picture, then say which way they move.", max_tokens=2)
        yield server, endpoints
    finally:
        server.stop()


@pytest.mark.parametrize("block", examples("python", kv_events=True))
def test_kv_events_example_runs(block, kv_events_server, workdir):
    _, endpoints = kv_events_server
    code = block
    for ours, doc in zip(endpoints, KV_EVENTS, strict=True):
        code = code.replace(doc, ours)
    out = subprocess.run([sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert "kv@pod-0@demo_model" in out.stdout, out.stdout[-2000:]   # it printed stored blocks
