"""`mmserve generate` end to end against a real server, in a subprocess like a user would run it."""

from __future__ import annotations

import json
import subprocess
import sys

from mmserve.clients import Client


def mmserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmserve.cli", "--log-level", "WARNING", *args],
                          capture_output=True, text=True, timeout=180)


def test_generate_streams_text_and_json(mmserve_server, tmp_path, video_bytes):
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(video_bytes)
    common = ["generate", "--server", mmserve_server.address, "--video", str(clip), "--num-frames", "2",
              "--prompt", "Describe the video.", "--max-tokens", "5", "--temperature", "0"]
    as_json = mmserve(*common, "--json")
    assert as_json.returncode == 0, as_json.stderr
    result = json.loads(as_json.stdout)
    with Client(mmserve_server.address, timeout=120) as client:
        direct = client.generate(prompt="Describe the video.", video=video_bytes, num_frames=2, max_tokens=5,
                                 temperature=0)
    assert result["token_ids"] == list(direct.token_ids)
    assert result["finish_reason"] == direct.finish_reason and result["usage"]["num_frames"] == 2
    plain = mmserve(*common)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == direct.text + "\n"


def test_generate_reports_the_status_and_exits_nonzero(mmserve_server, tmp_path):
    bad = mmserve("generate", "--server", mmserve_server.address, "--prompt", "hi", "--temperature", "-1")
    assert bad.returncode == 2
    assert "INVALID_ARGUMENT" in bad.stderr and "sampling.temperature" in bad.stderr
    missing = mmserve("generate", "--server", mmserve_server.address, "--prompt", "hi",
                      "--video", str(tmp_path / "missing.mp4"))
    assert missing.returncode == 2 and "missing.mp4" in missing.stderr


def test_unreachable_server_is_unavailable():
    out = mmserve("generate", "--server", "127.0.0.1:1", "--prompt", "hi", "--timeout", "5")
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr


def test_demo_without_a_server_says_how_to_start_one():
    """A newcomer ran `mmserve demo` first (its help said it starts a server) and got a bare UNAVAILABLE."""
    out = mmserve("demo", "--server", "127.0.0.1:1", "--timeout", "5")
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr
    assert "make run" in out.stderr and "127.0.0.1:1" in out.stderr
    assert "running server" in mmserve("--help").stdout.split("mmserve demo", 1)[1].split("\n")[0]


def test_the_demo_clients_start_without_torch():
    """`mmserve demo` and `mmserve eval-demo` need the demo task's prompt, clips and schema, not the
    featurisation that trains the demo model (torch: ~1.5 s of CPU before the first request)."""
    probe = "import sys, mmserve.clients.demo, mmserve.clients.eval_demo; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_sampling_flags_reach_the_server(mmserve_server, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    common = ["generate", "--server", mmserve_server.address, "--prompt", "Describe the video.", "--max-tokens", "24",
              "--temperature", "0"]
    constrained = mmserve(*common, "--json-schema", str(schema), "--logprobs", "--top-logprobs", "2",
                          "--presence-penalty", "0.3", "--logit-bias", "20=-2.5", "--json")
    assert constrained.returncode == 0, constrained.stderr
    result = json.loads(constrained.stdout)
    assert set(json.loads(result["text"])) == {"ok"}
    assert len(result["logprobs"]) == len(result["token_ids"]) and len(result["logprobs"][0]["top"]) == 2
    table = mmserve(*common, "--regex", "(yes|no)", "--logprobs")
    assert table.returncode == 0 and table.stdout.strip() in ("yes", "no")
    assert "rank" in table.stderr
    samples = mmserve(*common[:-1], "1", "--max-tokens", "6", "--n", "2", "--seed", "5")
    assert samples.returncode == 0, samples.stderr
    assert [line[:3] for line in samples.stdout.splitlines()] == ["[0]", "[1]"]
    bad = mmserve(*common, "--logit-bias", "nope")
    assert bad.returncode == 2 and "TOKEN_ID=BIAS" in bad.stderr


def test_window_system_and_ignore_eos_flags(mmserve_server, tmp_path):
    """--start/--end sample inside the window (the JSON result lists the frames' absolute times),
    --system adds a system turn (another prompt, as the client's system= builds it), --ignore-eos
    runs to --max-tokens; --log-level also works after the subcommand."""
    from mmserve.multimodal.synthetic import make_clip

    clip = tmp_path / "long.mp4"
    clip.write_bytes(make_clip(4, num_frames=12, fps=2).data)  # 6 s
    args = ["generate", "--server", mmserve_server.address, "--video", str(clip), "--num-frames", "2",
            "--prompt", "Describe the video.", "--max-tokens", "6", "--temperature", "0", "--json",
            "--log-level", "ERROR"]
    out = mmserve(*args, "--start", "2", "--end", "4", "--system", "Answer briefly.", "--ignore-eos")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["videos"][0]["timestamps_s"] == [2.0, 3.0]
    assert result["finish_reason"] == "length" and len(result["token_ids"]) == 6
    with Client(mmserve_server.address, timeout=120) as client:
        direct = client.generate(prompt="Describe the video.", video=clip, num_frames=2, start_s=2, end_s=4,
                                 system="Answer briefly.", max_tokens=6, temperature=0, ignore_eos=True)
        plain = client.generate(prompt="Describe the video.", video=clip, num_frames=2, start_s=2, end_s=4,
                                max_tokens=6, temperature=0, ignore_eos=True)
    assert result["token_ids"] == list(direct.token_ids)
    assert result["usage"]["prompt_tokens"] == direct.usage.prompt_tokens > plain.usage.prompt_tokens


def test_trace_without_an_endpoint_says_so_in_the_clients_words(mmserve_server, monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    out = subprocess.run([sys.executable, "-m", "mmserve.cli", "generate", "--server", mmserve_server.address,
                          "--prompt", "hi", "--max-tokens", "1", "--trace"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "trace id: " in out.stderr and "not exported: set OTEL_EXPORTER_OTLP_ENDPOINT" in out.stderr
    assert "--otlp-traces-endpoint" not in out.stderr  # the server's flag means nothing to a client
