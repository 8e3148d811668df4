"""`mmserve generate`: send a prompt (and a video/image file) to a server and stream the answer.

A file larger than the server takes in one message (GetModelInfo.max_inline_media_bytes) is
uploaded first, with a progress bar on a terminal, and the request names it by its id.

Text goes to stdout as it arrives; `--json` prints one object with the whole result instead. On a
failed call it prints the gRPC status code and message to stderr and exits non-zero (2 for a bad
request, 1 otherwise), so scripts can tell the two apart.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc

from mmserve.clients.client import Client
from mmserve.clients.types import ClientError


def add_connection_args(p: argparse.ArgumentParser) -> None:
    """--server, --timeout, --api-key and --tls-ca: how a subcommand reaches the server."""
    p.add_argument("--server", default="127.0.0.1:50051",
                   help="HOST:PORT, or a gRPC target such as ipv4:a:p1,b:p2 or dns:///host:port")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--api-key", default=None, help="sent as 'authorization: Bearer KEY' (env MMSERVE_API_KEY)")
    p.add_argument("--tls-ca", type=Path, default=None, help="CA bundle (PEM) to verify a TLS server")


def connect(args: argparse.Namespace, *, trace: bool = False) -> Client:
    root = args.tls_ca.read_bytes() if args.tls_ca else None
    return Client(args.server, api_key=args.api_key or os.environ.get("MMSERVE_API_KEY"), root_certificates=root,
                  timeout=args.timeout, trace=trace)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="send a video/image + text prompt to a server, stream the answer",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_connection_args(p)
    p.add_argument("--prompt", required=True, help="the text of the user turn")
    p.add_argument("--system", default=None, help="a system turn before it (instructions for the model)")
    p.add_argument("--video", type=Path, help="a video file (mp4, webm, mkv, ...); uploaded first (with a progress "
                                              "bar) when larger than the server takes inline")
    p.add_argument("--image", type=Path, help="an image file (png, jpeg, ...); uploaded first when too large inline")
    p.add_argument("--audio", type=Path, help="an audio file (wav, flac, mp3, ogg, m4a) for a model that hears "
                   "(Gemma 4 E2B/E4B); uploaded first when too large inline")
    p.add_argument("--use-audio-in-video", action="store_true",
                   help="the model also hears the video's soundtrack (the window's, after its frames)")
    p.add_argument("--num-frames", type=int, default=0, help="frames to sample from the video; 0 = server default")
    p.add_argument("--fps", type=float, default=0.0, help="sample frames at this rate instead (at most the "
                   "server's max frames per video, then spread uniformly)")
    p.add_argument("--start", type=float, default=0.0, metavar="SECONDS",
                   help="sample only from this time on (seconds from the video's start)")
    p.add_argument("--end", type=float, default=0.0, metavar="SECONDS", help="sample only before this time; 0 = the end")
    p.add_argument("--max-tokens", type=int, default=0, help="0 = server default")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy; unset = 1.0")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep the most likely tokens up to "
                   "this probability mass, in (0, 1]; unset = 1 (off)")
    p.add_argument("--top-k", type=int, default=0, help="keep only the K most likely tokens; 0 = off")
    p.add_argument("--seed", type=int, default=None, help="seed this request's sampling, for reproducible output")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence, up to "
                   "--max-tokens (for benchmarks)")
    p.add_argument("--n", type=int, default=0, help="independent samples of the prompt (printed one per line)")
    p.add_argument("--min-tokens", type=int, default=0, help="hold back end-of-sequence and stop strings until this many")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="[-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="[-2, 2]")
    p.add_argument("--repetition-penalty", type=float, default=None, help="(0, 10]; 1 = off")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS", type=_bias,
                   help="add BIAS in [-100, 100] to token ID's logit (repeatable)")
    p.add_argument("--logprobs", action="store_true", help="return each token's logprob (printed to stderr)")
    p.add_argument("--top-logprobs", type=int, default=0, help="alternatives per token (0..20)")
    p.add_argument("--prompt-logprobs", action="store_true", help="return the prompt tokens' logprobs (--json)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", type=_text_or_file, help="constrain the output to this JSON schema "
                     "(inline JSON or a file)")
    fmt.add_argument("--regex", help="constrain the output to this regular expression")
    fmt.add_argument("--grammar", type=_text_or_file, help="constrain the output to this EBNF grammar "
                     "(inline or a file; the start rule is `root`)")
    p.add_argument("--json", action="store_true", help="print the whole result as one JSON object")
    p.add_argument("--trace", action="store_true",
                   help="run the call inside a client span sent as W3C traceparent and print its trace id to "
                        "stderr (the span is exported over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set)")
    p.set_defaults(func=run)


def _bias(value: str) -> tuple[int, float]:
    token, sep, bias = value.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS, got {value!r}") from None


def _text_or_file(value: str) -> str:
    """A path to a file holding the text, or the text itself."""
    path = Path(value)
    try:
        return path.read_text() if len(value) < 4096 and path.is_file() else value
    except OSError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _print_logprobs(result) -> None:
    for lp in result.logprobs:
        alts = "  ".join(f"{t.text!r} {t.logprob:.3f}" for t in lp.top)
        print(f"{lp.text!r}\t{lp.logprob:.4f}\trank {lp.rank}" + (f"\t| {alts}" if alts else ""), file=sys.stderr)


@contextlib.contextmanager
def _client_span(enabled: bool) -> Iterator[None]:
    """With --trace: a span of our own, so the server's request span joins a trace whose id we know."""
    if not enabled:
        yield
        return
    from opentelemetry.sdk.trace import TracerProvider

    from mmserve.metrics.tracing import configure_tracing, traces_endpoint

    # Without an endpoint the client span is only a trace id to look up on the server's side; say
    # so in the client's words (configure_tracing's "tracing off" line names the server's flags).
    exported = traces_endpoint() is not None
    provider = (configure_tracing(service_name="mmserve-client") if exported else None) or TracerProvider()
    try:
        with provider.get_tracer("mmserve.clients").start_as_current_span("mmserve.client.generate") as span:
            where = "" if exported else " (this client span is not exported: set OTEL_EXPORTER_OTLP_ENDPOINT)"
            print(f"trace id: {span.get_span_context().trace_id:032x}{where}", file=sys.stderr)
            yield
    finally:
        provider.shutdown()


def run(args: argparse.Namespace) -> int:
    missing = [path for path in (args.video, args.image, args.audio) if path is not None and not path.is_file()]
    if missing:
        print(f"mmserve generate: no such file: {missing[0]}", file=sys.stderr)
        return 2
    with _client_span(args.trace), connect(args, trace=args.trace) as client:
        try:
            # The client reads the files, or uploads those larger than the server takes inline.
            stream = client.stream(prompt=args.prompt, video=args.video, image=args.image, audio=args.audio,
                                   use_audio_in_video=args.use_audio_in_video, system=args.system,
                                   num_frames=args.num_frames, fps=args.fps, start_s=args.start, end_s=args.end,
                                   ignore_eos=args.ignore_eos, max_tokens=args.max_tokens, temperature=args.temperature,
                                   top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                                   min_tokens=args.min_tokens, presence_penalty=args.presence_penalty,
                                   frequency_penalty=args.frequency_penalty,
                                   repetition_penalty=args.repetition_penalty, logit_bias=dict(args.logit_bias),
                                   logprobs=args.logprobs, top_logprobs=args.top_logprobs,
                                   prompt_logprobs=args.prompt_logprobs, json_schema=args.json_schema,
                                   regex=args.regex, grammar=args.grammar, n=args.n)
            for delta in stream:
                if not args.json and args.n <= 1:
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
            result = stream.result
        except ClientError as e:
            print(f"mmserve generate: {e.code.name}: {e.message}", file=sys.stderr)
            return 2 if e.code == grpc.StatusCode.INVALID_ARGUMENT else 1
        except OSError as e:
            print(f"mmserve generate: {e}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(dataclasses.asdict(result)))
    elif result.samples:
        for sample in result.samples:
            print(f"[{sample.index}] {sample.text!r} ({sample.finish_reason})")
    else:
        sys.stdout.write("\n")
        if args.logprobs:
            _print_logprobs(result)
    return 0
