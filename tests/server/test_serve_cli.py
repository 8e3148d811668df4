"""`mmserve serve` exposes every EngineConfig and ServerConfig option as a flag."""

from __future__ import annotations

import dataclasses

from mmserve.cli import build_parser
from mmserve.config import EngineConfig, ServerConfig, flag_names, from_args


def test_every_config_field_is_a_flag(monkeypatch):
    monkeypatch.delenv("MMSERVE_MAX_NUM_SEQS", raising=False)
    monkeypatch.setenv("MMSERVE_BLOCK_SIZE", "32")
    argv = ["serve", "--port", "0", "--max-num-seqs", "3", "--auth-health", "--model", "/tmp/ckpt"]
    parser = build_parser(argv)
    serve = parser._subparsers._group_actions[0].choices["serve"]
    options = {s for a in serve._actions for s in a.option_strings}
    assert set(flag_names(EngineConfig)) | set(flag_names(ServerConfig)) <= options
    args = parser.parse_args(argv)
    engine, server = from_args(EngineConfig, args), from_args(ServerConfig, args)
    assert (server.port, server.auth_health, engine.max_num_seqs, engine.model) == (0, True, 3, "/tmp/ckpt")
    assert engine.block_size == 32  # from the environment
    untouched = {f.name for f in dataclasses.fields(EngineConfig)} - {"max_num_seqs", "model", "block_size"}
    assert all(getattr(engine, n) == getattr(EngineConfig(), n) for n in untouched)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "mmserve.cli", "serve", "--port", "0", "--model", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"no checkpoint at {tmp_path}" in out.stderr and "Traceback" not in out.stderr


def test_a_hub_id_as_model_gets_the_download_hint(tmp_path, monkeypatch):
    """`--model google/gemma-4-E2B-it` (what a vLLM user types) said only that config.json was missing."""
    from mmserve.server.cli import missing_checkpoint

    monkeypatch.chdir(tmp_path)
    hint = missing_checkpoint("google/gemma-4-E2B-it")
    assert "Hugging Face Hub id" in hint and "huggingface-cli download google/gemma-4-E2B-it --local-dir" in hint
    assert "downloads nothing" in hint
    (tmp_path / "org").mkdir()
    for local in ("org", str(tmp_path / "missing"), "./a/b"):
        assert "Hub id" not in missing_checkpoint(local), local


def test_dtype_auto_is_bfloat16_on_cuda_and_float32_on_cpu(monkeypatch):
    import torch

    from mmserve.config import default_dtype
    from mmserve.model.loader import resolve_dtype

    assert EngineConfig(device="cpu").dtype == "float32"          # resolved when the config is built
    assert EngineConfig(device="cuda:1").dtype == "bfloat16"
    assert EngineConfig(device="cuda", dtype="float32").dtype == "float32"   # an explicit choice stays
    assert resolve_dtype("auto", torch.device("cuda", 0)) is torch.bfloat16
    assert resolve_dtype("auto", "cpu") is torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_dtype("auto") == "bfloat16" and EngineConfig().dtype == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EngineConfig().dtype == "float32"
