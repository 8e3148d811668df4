"""Regenerate the committed gRPC stubs from proto/ (`make proto`).

Imports inside the generated *_pb2_grpc.py are rewritten to package-relative form so the stubs
work as `mmserve.api.mmserve.v1.*` without touching sys.path.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
OUT_DIR = Path(__file__).resolve().parent / "api"


def generate(out_dir: Path = OUT_DIR) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    written = []
    for path in sorted(out_dir.rglob("*_pb2*.py*")):
        text = path.read_text()
        text = re.sub(r"^from mmserve\.v1 import (\w+) as", r"from . import \1 as", text, flags=re.M)
        path.write_text(text)
        written.append(path)
    for pkg in {p.parent for p in written} | {out_dir / "mmserve"}:
        init = pkg / "__init__.py"
        if not init.exists():
            init.write_text("")
    return written


if __name__ == "__main__":
    for p in generate():
        print(p.relative_to(ROOT))
    sys.exit(0)
