"""Kernels one decode step launches per decoder layer on the CUDA code path, counted on this CPU.

    python bench/kernel_count.py [--models 12b_unified 26b_a4b ...] [--rows 1] [--json out.json]

(`--rows 16` / `--rows 64`: a batch's decode step, the graph compiled for any row count but one.)

One layer of each kind of each model (tests/fixtures/gemma4_family: sliding, full, KV-sharing, MoE
layers) is built at the model's real dimensions (bf16, uninitialised weights: values do not change
the code) and runs one forward of `rows` decode rows with the layer pieces compiled by inductor, as
the model runner does on CUDA (model/layer_pieces.py). Launches are counted three ways, each mapped
to CUDA as stated:
- inside a compiled piece, from inductor's generated wrapper (`call`): one per generated kernel
  (`cpp_fused_*` here; Triton kernels on CUDA, made by the same scheduler from the same fused node
  groups) and one per extern call (`extern_kernels.mm` -> one cuBLAS GEMM, a fallback op -> its
  ATen kernel; an op of ours, `torch.ops.mmserve.*` -> its CUDA implementation's one launch: PLE's
  `ple_gated_projection` is one Triton kernel on CUDA, though on this CPU it runs two ATen ops);
- outside the pieces, one per ATen op the forward dispatches that computes (views, allocations
  and metadata ops launch nothing), counted by a dispatch mode that is paused inside the pieces;
- the attention call: one (on CUDA a decode step's is the split-KV kernel, one launch whether it
  splits the keys or not: its last split merges; FA4's or flex's kernel otherwise; the K/V write
  is fused into `attn_in`); collectives: none at one rank (each would add one NCCL launch).
Where the C++ and Triton backends fuse differently (C++ runs independent reductions of different
shapes in one loop nest, Triton as separate kernels: q and k norm + RoPE; Triton may split a long
reduction at one row), the CUDA count can be a kernel or two higher per piece; `profile` in
bench/gpu_check.py counts the real launches on a GPU. These are decode steps (uniform graphs); a
piecewise step (prefill chunks, mixed steps) launches one more kernel per layer, inside the piece
before attention: q copied into the persistent buffer attention reads (worker/piecewise_graphs.py).

Prints one line per layer kind per model, ending in `N kernels per layer`, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mmserve.model import compiled, decoder, layer_pieces, moe  # noqa: E402
from mmserve.model.spec import LayerSpec, ModelSpec, load_spec  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "gemma4_family"
MODELS = ("e2b", "e4b", "12b_unified", "26b_a4b", "31b")
PIECES = ("attn_in", "mlp_in", "mlp_moe_in", "layer_out")
# A generated kernel or an extern / fallback call in inductor's wrapper code.
_LAUNCH = re.compile(r"^\s*(?:buf\w+ = )?(cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(", re.M)
# Dispatched ops that launch nothing.
_FREE = {"empty", "empty_strided", "empty_like", "lift_fresh", "detach", "alias", "_to_copy_noop"}


@dataclass
class LayerCount:
    model: str
    kind: str
    pieces: dict[str, list[str]] = field(default_factory=dict)   # piece -> its launches
    eager: list[str] = field(default_factory=list)               # ops dispatched outside the pieces
    attention: int = 1

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.pieces.values()) + len(self.eager) + self.attention

    def line(self) -> str:
        return f"{self.model} {self.kind}: {self.total} kernels per layer"


class EagerLaunches(TorchDispatchMode):
    """Every computing ATen op dispatched while active (one CUDA launch each)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _FREE:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def launches(code: str) -> list[str]:
    """The launches of inductor's generated wrapper: the calls in its `call` function."""
    body = code[code.index("def call("):]
    body = body[:body.index("\nrunner = ")] if "\nrunner = " in body else body
    return _LAUNCH.findall(body)


def layer_kinds(spec: ModelSpec) -> dict[str, LayerSpec]:
    """The first layer of each kind: its type, plus KV-sharing and experts when it has them."""
    kinds: dict[str, LayerSpec] = {}
    for layer in spec.layers:
        kind = layer.layer_type + (" kv-shared" if layer.shares_kv else "") + (" moe" if layer.moe else "")
        kinds.setdefault(kind, layer)
    return kinds


class StubAttention:
    """Stands in for the attention kernel (one launch, counted apart): returns q, reads nothing."""

    def forward(self, q, k, v, kv_cache, metadata):
        return q


def stub_metadata(rows: int, block_size: int) -> SimpleNamespace:
    """What a layer reads of its backend's metadata itself: the step's K/V slots."""
    slots = torch.arange(rows, dtype=torch.int64) + block_size   # block 1 onwards
    return SimpleNamespace(common=SimpleNamespace(slot_mapping=slots, num_actual_tokens=rows))


def build_layer(spec: ModelSpec, layer: LayerSpec, dtype: torch.dtype) -> decoder.DecoderLayer:
    impl = StubAttention()
    with torch.device("meta"):
        module = decoder.DecoderLayer(spec, layer, impl)
    module = module.to_empty(device="cpu").to(dtype)
    for p in module.parameters():
        p.data.normal_(0, 0.02)   # finite values: softmax/top-k of uninitialised memory may be NaN
    module.layer_scalar.fill_(1.0)   # a buffer: to_empty left it uninitialised, as the constructor's ones(1) was on meta
    if module.moe is not None:
        module.moe.experts.touched.zero_()   # its buffer is allocated once, not by a step
    return module.eval()


def count_layer(model: str, spec: ModelSpec, kind: str, layer: LayerSpec, rows: int,
                dtype: torch.dtype = torch.bfloat16) -> LayerCount:
    from torch._inductor.utils import run_and_get_code

    result = LayerCount(model, kind)
    module = build_layer(spec, layer, dtype)
    attn = spec.attention_specs[layer.layer_type]
    block_size = 16
    kv_cache = torch.zeros(2, 4 + rows // block_size, block_size, attn.num_kv_heads, attn.head_dim, dtype=dtype)
    h = torch.randn(rows, spec.hidden_size, dtype=dtype)
    cos = torch.randn(rows, attn.head_dim, dtype=dtype)
    sin = torch.randn(rows, attn.head_dim, dtype=dtype)
    layer_input = None if spec.ple is None else torch.randn(rows, spec.ple.dim, dtype=dtype)
    counter = EagerLaunches()
    originals = {name: getattr(moe if name == "mlp_moe_in" else layer_pieces, name) for name in PIECES}

    def counted(name, piece):
        def run(*args):
            with _disable_current_modes():
                torch._dynamo.reset()
                out, codes = run_and_get_code(piece, *args)
            result.pieces[name] = [launch for code in codes for launch in launches(code)]
            return out
        run.eager = piece.eager   # a piece that runs another's body inside its own (mlp_moe_in: mlp_in's)
        return run

    compiled.set_compiled(False, layers=True)
    patched = [(mod, name) for mod in (decoder, moe, layer_pieces) for name in originals if hasattr(mod, name)]
    patched.append((moe, "uses_grouped_mm"))   # the experts' CUDA dispatch (this torch runs it on a CPU too)
    saved = {(mod, name): getattr(mod, name) for mod, name in patched}
    try:
        for mod, name in patched[:-1]:
            setattr(mod, name, counted(name, originals[name]))
        moe.uses_grouped_mm = lambda x: True
        metadata = stub_metadata(rows, block_size)
        with torch.inference_mode(), counter:
            module(h, h, cos, sin, kv_cache, metadata, layer_input, module.input_layernorm)
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)
        compiled.set_compiled(False)
    result.eager = counter.ops
    return result


def table(counts: list[LayerCount]) -> str:
    lines = ["| model | layer kind | " + " | ".join(PIECES) + " | outside pieces | attention | total |",
             "|---|---|" + "---|" * (len(PIECES) + 3)]
    for c in counts:
        cells = [str(len(c.pieces[p])) if p in c.pieces else "-" for p in PIECES]
        lines.append(f"| {c.model} | {c.kind} | " + " | ".join(cells) +
                     f" | {len(c.eager)} ({', '.join(c.eager) or 'none'}) | {c.attention} | **{c.total}** |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--rows", type=int, default=1, help="decode rows of the step (batch size)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    counts = []
    for name in args.models:
        spec = load_spec(FIXTURES / f"{name}.json")
        for kind, layer in layer_kinds(spec).items():
            c = count_layer(name, spec, kind, layer, args.rows)
            print(c.line(), flush=True)
            counts.append(c)
    print()
    print(table(counts))
    if args.json:
        args.json.write_text(json.dumps([{"model": c.model, "kind": c.kind, "total": c.total, "pieces": c.pieces,
                                          "eager": c.eager} for c in counts], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
