"""Every `mmserve` subcommand registers: a broken import fails here, not on a user's machine."""

import pytest

from mmserve.cli import SUBCOMMANDS, build_parser
from mmserve.config import EngineConfig, from_args


def test_top_level_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser(["--help"]).parse_args(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in SUBCOMMANDS)


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_each_subcommand_has_a_handler(name):
    subparsers = next(a for a in build_parser([name])._actions if a.dest == "command")
    assert subparsers.choices[name].get_default("func") is not None


def _mmserve(*args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "mmserve.cli", *args], capture_output=True, text=True, timeout=120)


def test_version():
    from mmserve import __version__

    out = _mmserve("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"mmserve {__version__}"


def test_every_flag_and_subcommand_has_help():
    import argparse

    parser = build_parser([])
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert {c.dest for c in subparsers._choices_actions if c.help} == set(SUBCOMMANDS)
    missing = [f"{name} {a.option_strings or a.dest}" for name, sub in [("mmserve", parser), *subparsers.choices.items()]
               for a in sub._actions if not a.help and not isinstance(a, argparse._SubParsersAction)]
    assert not missing, missing


def test_top_level_help_describes_the_tool():
    out = build_parser(["--help"]).format_help()
    assert "Serve a Gemma 4 video+text model over gRPC" in out and "mmserve generate" in out


def test_global_flags_also_after_the_subcommand():
    parser = build_parser(["serve"])
    after = parser.parse_args(["serve", "--log-level", "DEBUG", "--log-format", "json"])
    before = parser.parse_args(["--log-level", "WARNING", "serve"])
    neither = parser.parse_args(["serve"])
    assert (after.log_level, after.log_format) == ("DEBUG", "json")
    assert (before.log_level, before.log_format) == ("WARNING", "text")
    assert (neither.log_level, neither.log_format) == ("INFO", "text")


@pytest.mark.parametrize("argv,hint", [
    (["serve", "--prot", "5"], "--prot: did you mean --port"),
    (["generate", "--prompt", "x", "--tmperature", "1"], "--tmperature: did you mean --temperature"),
    (["serve", "--log-levl", "DEBUG"], "--log-levl: did you mean --log-level"),
])
def test_typos_get_close_matches(argv, hint):
    out = _mmserve(*argv)
    assert out.returncode == 2 and "unrecognized arguments" in out.stderr and hint in out.stderr


def test_make_run_passes_args_and_honours_the_env():
    import os
    import subprocess

    env = dict(os.environ, MMSERVE_HOST="0.0.0.0", MMSERVE_PORT="6123")
    out = subprocess.run(["make", "-n", "run", "ARGS=--log-level DEBUG --max-num-seqs 4"], capture_output=True,
                         text=True, env=env, cwd=str(__import__("pathlib").Path(__file__).parent.parent), timeout=60)
    assert out.returncode == 0, out.stderr
    assert ("mmserve serve --host 0.0.0.0 --port 6123 --speculative-model 'src/mmserve/demo_assistant' "
            "--log-level DEBUG --max-num-seqs 4") in out.stdout


@pytest.mark.parametrize("env,flag", [({}, "'src/mmserve/demo_assistant'"),   # the demo model drafts by default
                                      ({"MMSERVE_SPECULATIVE_MODEL": ""}, "''"),   # the way to serve without
                                      ({"MMSERVE_MODEL": "/elsewhere"}, "''"),   # the demo assistant fits only it
                                      ({"ARGS": "--model /elsewhere"}, "''")])
def test_make_run_speculates_with_the_demo_assistant(env, flag):
    import os
    import subprocess

    base = {k: v for k, v in os.environ.items() if k not in ("MMSERVE_MODEL", "MMSERVE_SPECULATIVE_MODEL")}
    out = subprocess.run(["make", "-n", "run"], capture_output=True, text=True, env={**base, **env},
                         cwd=str(__import__("pathlib").Path(__file__).parent.parent), timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"--speculative-model {flag}" in out.stdout


def test_version_imports_no_torch():
    """`mmserve --version` took 2.5-3 s: it registered every subcommand, and `serve` imports torch."""
    import subprocess
    import sys

    code = "import sys; from mmserve.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass\n" \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["mmserve", "0.1.0", "False"], out


def _serve_usage_error(argv: list[str], capsys) -> str:
    """`mmserve serve ...argv` parsed in this process: the usage error's text (it must exit 2)."""
    with pytest.raises(SystemExit) as exit_:
        build_parser(["serve"]).parse_args(["serve", *argv])
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv,env,named", [
    # a boolean variable with any other word read False: health and reflection served without the key
    ([], {"MMSERVE_AUTH_HEALTH": "enabled"}, "argument --auth-health/--no-auth-health: 'enabled' is not one of "
                                             "1/true/yes/on, 0/false/no/off (from MMSERVE_AUTH_HEALTH)"),
    # failed minutes later, once the weights had loaded
    (["--backend-self-check", "bogus"], {}, "'bogus' is not one of auto, on, off"),
    # 0 expired every media job at once (a retryable error: clients retried forever), failed every start,
    # refused every response_format
    (["--video-decode-timeout-s", "0"], {}, "below the minimum 0.001"),
    (["--engine-ready-timeout-s", "0"], {}, "below the minimum 0.001"),
    (["--grammar-compile-timeout-s", "0"], {}, "below the minimum 0.001"),
    # 0 refused every video and every audio part as too long, and deleted every upload within 0.05 s
    # of its commit (the sweeper's shortest sleep), before a request could name it
    (["--max-video-duration-s", "0"], {}, "argument --max-video-duration-s: 0 is below the minimum 0.001"),
    ([], {"MMSERVE_MAX_AUDIO_DURATION_S": "0"}, "argument --max-audio-duration-s: 0 is below the minimum 0.001 "
                                                "(from MMSERVE_MAX_AUDIO_DURATION_S)"),
    (["--media-ttl-s", "0"], {}, "argument --media-ttl-s: 0 is below the minimum 0.001"),
    (["--tensor-parallel-timeout-s", "inf"], {}, "'inf' is not finite"),   # OverflowError in the engine process
    ([], {"MMSERVE_MAX_STEP_SLOWDOWN": "-inf"}, "'-inf' is not finite (from MMSERVE_MAX_STEP_SLOWDOWN)"),
    (["--seed", str(2**64)], {}, f"above the maximum {2**64 - 1}"),   # torch.manual_seed refuses it
    (["--log-level", "loud"], {}, "argument --log-level: invalid choice: 'LOUD'"),   # was a traceback, exit 1
])
def test_bad_value_is_a_usage_error(argv, env, named, capsys, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert named in _serve_usage_error(argv, capsys)


@pytest.mark.parametrize("text,value", [("1", True), ("True ", True), ("YES", True), ("on", True),
                                        ("0", False), (" false", False), ("No", False), ("OFF", False)])
def test_boolean_variables_take_the_documented_words(text, value, monkeypatch):
    monkeypatch.setenv("MMSERVE_AUTH_HEALTH", text)
    monkeypatch.setenv("MMSERVE_ENABLE_PREFIX_CACHING", text)
    args = build_parser(["serve"]).parse_args(["serve"])
    assert (args.auth_health, args.enable_prefix_caching) == (value, value)
    flagged = build_parser(["serve"]).parse_args(["serve", "--auth-health" if not value else "--no-auth-health"])
    assert flagged.auth_health is not value   # the flag still wins over the variable


def test_log_level_is_case_insensitive():
    assert build_parser(["serve"]).parse_args(["serve", "--log-level", "debug"]).log_level == "DEBUG"


def test_frame_limits_that_refuse_every_default_video_stop_the_start(caplog, tmp_path):
    """--max-frames-per-request under the frames a video gets by default (8) was accepted: every video
    naming no count was decoded in full, then refused. (No checkpoint at --model: were the flags let
    through, the start would stop there instead, with another message.)"""
    from mmserve.server.cli import run

    argv = ["serve", "--model", str(tmp_path / "absent"), "--max-frames-per-request", "4"]
    assert run(build_parser(argv).parse_args(argv)) == 2
    assert "--max-frames-per-request 4 is below the 8 frames" in caplog.text and "--default-num-frames 8" in caplog.text
    assert "no checkpoint" not in caplog.text
    enough = build_parser(argv).parse_args([*argv, "--default-num-frames", "4"])
    assert from_args(EngineConfig, enough).max_frames_per_request == 4


@pytest.mark.parametrize("stall,refused", [("60", True), ("30", True), ("61", False), ("0", False)])
def test_a_stall_timeout_not_above_the_tensor_parallel_timeout_stops_the_start(stall, refused, caplog, tmp_path):
    """With tensor-parallel ranks, a stall timeout at or under --tensor-parallel-timeout-s (60) killed
    the engine as wedged before the hung rank could be named. 0 (never) is not refused; without ranks
    the tensor-parallel timeout is not used, and any stall timeout is taken. (No checkpoint at --model:
    flags let through stop the start there, with that message.)"""
    from mmserve.server.cli import run

    argv = ["serve", "--model", str(tmp_path / "absent"), "--tensor-parallel-size", "2",
            "--engine-stall-timeout-s", stall]
    assert run(build_parser(argv).parse_args(argv)) == 2
    named = f"--engine-stall-timeout-s {stall} is not above --tensor-parallel-timeout-s 60"
    assert (named in caplog.text, "no checkpoint" in caplog.text) == (refused, not refused)
    single = ["serve", "--model", str(tmp_path / "absent"), "--engine-stall-timeout-s", stall]
    assert from_args(EngineConfig, build_parser(single).parse_args(single)).engine_stall_timeout_s == float(stall)
