"""Every shell and Python example of README.md and docs/api.md runs as written against a real
server (the session's demo-model server), in a directory holding the files they name.

Only what cannot run on this machine is adapted or left out: the address (the examples say
127.0.0.1:50051, the test server has an ephemeral port; `mmserve` subcommands that rely on the
default `--server` get it), `.venv/bin/` (the test's interpreter runs `mmserve`), `make demo`
(it is `mmserve demo`), and blocks that start servers or containers (`make run`, `make test`,
`docker run`), which the suite covers elsewhere (tests/test_cli.py checks `make run`'s command).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from mmserve.multimodal.synthetic import make_clip

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/api.md")
DEFAULT_ADDRESS = "127.0.0.1:50051"
NOT_HERE = re.compile(r"^\s*(make (run|test)\b|docker )", re.M)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def examples(lang: str) -> list[pytest.param]:
    found = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for m in FENCE.finditer(text):
            if m.group(1) == lang or (lang == "sh" and m.group(1) == "" and "mmserve" in m.group(2)):
                line = text.count("\n", 0, m.start()) + 1
                if not NOT_HERE.search(m.group(2)):
                    found.append(pytest.param(m.group(2), id=f"{doc}:{line}"))
    return found


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The files the examples name: clip.mp4, meeting.mp4 (longer), cat.png, schema.json."""
    path = tmp_path_factory.mktemp("docs")
    (path / "clip.mp4").write_bytes(make_clip(7).data)
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
    assert len(examples("sh")) >= 6 and len(examples("python")) >= 2


@pytest.mark.parametrize("block", examples("sh"))
def test_shell_example_runs(block, mmserve_server, workdir):
    grpcurl = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    prelude = (f'mmserve() {{ "{sys.executable}" -m mmserve.cli "$@"; }}\n'
               f'grpcurl() {{ "{grpcurl}" "$@"; }}\nset -e -o pipefail\n')
    out = subprocess.run(["bash", "-c", prelude + adapted_shell(block, mmserve_server.address)], cwd=workdir,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert out.returncode == 0, f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


@pytest.mark.parametrize("block", examples("python"))
def test_python_example_runs(block, mmserve_server, workdir):
    code = block.replace(DEFAULT_ADDRESS, mmserve_server.address)
    out = subprocess.run([sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
