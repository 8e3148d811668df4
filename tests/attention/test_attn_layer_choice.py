"""Per-layer backend choice from the hardware, and `fa4_runs` checked against FA4 b36 itself.

The sweep builds FA4's real kernel objects for each (arch, head dim, dtype) under FakeTensorMode
with `cute.compile` stubbed out, so FA4's own validation and kernel constructors decide what it
accepts, in well under a second per shape; the full compiles are in test_attn_fa4_compile.py.
"""

from __future__ import annotations

import pytest
import torch

from mmserve.attention.backend import FULL, SLIDING, LayerAttentionSpec
from mmserve.attention.selection import choose_backends, device_arch, fa4_runs, split_kv_decode

GEMMA4 = {SLIDING: LayerAttentionSpec(SLIDING, 16, 8, 256, window=1024, bidirectional=True),
          FULL: LayerAttentionSpec(FULL, 16, 2, 512, window=None, bidirectional=False)}
BF16 = torch.bfloat16


@pytest.mark.parametrize(("arch", "head_dim", "dtype", "runs"), [
    (90, 256, BF16, True), (90, 128, torch.float16, True), (90, 512, BF16, False), (90, 8, BF16, True),
    (90, 260, BF16, False), (90, 100, BF16, False),
    (100, 128, BF16, True), (100, 256, BF16, True), (100, 192, BF16, False), (100, 512, BF16, False),
    (103, 256, BF16, True), (110, 64, BF16, True),
    (80, 128, BF16, False), (120, 128, BF16, False), (None, 128, BF16, False),
    (90, 128, torch.float32, False), (100, 256, torch.float32, False),
])
def test_fa4_runs_follows_b36(arch, head_dim, dtype, runs):
    assert fa4_runs(arch, head_dim, head_dim, dtype) is runs


def test_gemma4_layers_on_each_machine():
    def choose(device_type, arch, dtype=BF16, installed=True, requested="auto"):
        return choose_backends(GEMMA4, device_type=device_type, arch=arch, dtype=dtype, fa4_installed=installed,
                               requested=requested)
    hybrid = {SLIDING: "fa4", FULL: "flex"}
    assert choose("cuda", 90) == hybrid                      # H100 / H200
    assert choose("cuda", 100) == hybrid                     # B200: 512 is not FA4's either
    assert choose("cuda", 90, requested="fa4") == hybrid
    assert choose("cuda", 80) == {SLIDING: "flex", FULL: "flex"}            # A100: no paged FA4
    assert choose("cuda", 90, dtype=torch.float32) == {SLIDING: "flex", FULL: "flex"}
    assert choose("cuda", 90, installed=False) == {SLIDING: "flex", FULL: "flex"}
    assert choose("cpu", None) == {SLIDING: "sdpa", FULL: "sdpa"}
    assert choose("cpu", None, requested="fa4") == {SLIDING: "sdpa", FULL: "sdpa"}
    assert choose("cuda", 90, requested="sdpa") == {SLIDING: "sdpa", FULL: "sdpa"}


def test_device_arch_reads_the_override(monkeypatch):
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_100a")
    assert device_arch("cuda") == 100
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_90")
    assert device_arch("cpu") == 90
    monkeypatch.delenv("FLASH_ATTENTION_ARCH")
    assert device_arch("cpu") is None


def fa4_builds_kernel(arch: int, head_dim: int, dtype: torch.dtype, num_splits: int = 1) -> bool:
    """FA4's own answer: its validation and kernel constructor accept this paged varlen call."""
    from flash_attn.cute.interface import _flash_attn_fwd
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(300, 16, head_dim, dtype=dtype, device="cuda")
        k = torch.empty(64, 16, 8, head_dim, dtype=dtype, device="cuda")
        v = torch.empty_like(k)   # distinct K and V: the same tensor would switch FA4 to its MLA formula
        qsl = torch.empty(4, dtype=torch.int32, device="cuda")
        seq = torch.empty(3, dtype=torch.int32, device="cuda")
        table = torch.empty(3, 32, dtype=torch.int32, device="cuda")
        try:
            _flash_attn_fwd(q, k, v, cu_seqlens_q=qsl, seqused_k=seq, page_table=table, max_seqlen_q=200,
                            max_seqlen_k=512, causal=True, num_splits=num_splits, _arch=arch)
        except (AssertionError, NotImplementedError, ValueError):
            return False
    return True


@pytest.fixture
def fa4_constructors(monkeypatch):
    """Sets FA4's compilation target to an arch (the function it yields) with `cute.compile` stubbed:
    the kernel classes FA4 builds are listed, nothing is compiled, and its cache is left as it was."""
    pytest.importorskip("flash_attn.cute", reason="flash-attn-4 not installed (the fa4-check extra)")
    import cutlass.cute as cute
    from flash_attn.cute.flash_fwd import BaseDSL
    from flash_attn.cute.interface import _flash_attn_fwd

    dsl_env = BaseDSL._get_dsl().envar   # kernel constructors check the compilation target's arch
    built = []
    monkeypatch.setattr(cute, "compile", lambda kernel, *args, **kw: built.append(type(kernel).__name__))
    monkeypatch.setenv("FLASH_ATTENTION_NUM_SMS", "132")
    cache = _flash_attn_fwd.compile_cache.cache
    before = set(cache)

    def target(arch: int) -> list[str]:
        monkeypatch.setattr(dsl_env, "arch", f"sm_{arch}" + ("" if arch == 80 else "a"))
        return built
    yield target
    for key in set(cache) - before:   # the stubs must not stay in FA4's kernel cache
        del cache[key]


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_fa4_runs_matches_fa4_kernel_constructors(fa4_constructors):
    for arch in (90, 100, 110, 80, 120):
        built = fa4_constructors(arch)
        shapes = [(d, BF16) for d in (64, 128, 192, 256, 512)] + [(128, torch.float32)]
        for head_dim, dtype in shapes:
            assert fa4_builds_kernel(arch, head_dim, dtype) == fa4_runs(arch, head_dim, head_dim, dtype), \
                (arch, head_dim, dtype)
    assert built and "FlashAttentionMLAForwardSm100" not in built


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_decode_takes_split_kv_where_the_layers_kernel_cannot_split_keys(fa4_constructors):
    """Decode and verify steps run our split-KV kernel on flex's layer types (its Triton kernel runs
    one program per query block and KV head) and on FA4's where b36 refuses split-KV (SM90: its
    own constructor says so), never on a CPU."""
    for arch in (80, 90, 100, 120):
        assert split_kv_decode("flex", "cuda", arch)
    for arch in (90, 100):
        fa4_constructors(arch)
        assert split_kv_decode("fa4", "cuda", arch) is not fa4_builds_kernel(arch, 256, BF16, num_splits=4), arch
    assert not split_kv_decode("flex", "cpu", None) and not split_kv_decode("sdpa", "cuda", 90)
