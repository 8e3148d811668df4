"""`mmserve` command: a thin dispatcher; each subcommand lives beside the code it drives."""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

from mmserve import __version__
from mmserve.logs import LOG_FORMATS, LOG_LEVELS, configure_logging

DESCRIPTION = """\
Serve a Gemma 4 video+text model over gRPC, and talk to it.

  mmserve serve                       start a server (the embedded demo model by default)
  mmserve generate --prompt ... --video clip.mp4
                                      ask a running server about a video (or an image)
  mmserve demo                        ask a running server (`make run`) about a generated clip and
                                      print its caption next to the truth
  mmserve live clip.mp4 --ask 2:"What moves?"
                                      stream a video into a live session, ask as it plays
  mmserve demo-live                   a live session on a clip whose shape turns back half way
  mmserve upload meeting.mp4          upload a large file once; requests name it by its media id
  mmserve demo-video --out clip.mp4   write a synthetic captioned clip
  mmserve eval-demo --server ...      the demo model's caption accuracy on held-out clips
  mmserve perf --hf-config DIR        FLOPs and bytes of one step per GPU, from a model's config
  mmserve worker --node-rank 1 ...    a further node's ranks of a multi-node tensor-parallel group
  mmserve traces                      print each request's span tree, received over OTLP (no Jaeger)

`mmserve SUBCOMMAND --help` lists a subcommand's flags; --log-level and --log-format may be given
before or after the subcommand.
"""

# subcommand -> module that defines `register(subparsers)`; imported lazily so `mmserve generate`
# never pays for torch.
SUBCOMMANDS = {
    "serve": "mmserve.server.cli",
    "generate": "mmserve.clients.cli",
    "upload": "mmserve.clients.upload_cli",
    "demo": "mmserve.clients.demo",
    "live": "mmserve.clients.live_cli",
    "demo-live": "mmserve.clients.demo_live",
    "perf": "mmserve.metrics.cli",
    "demo-video": "mmserve.multimodal.synthetic",
    "eval-demo": "mmserve.clients.eval_demo",
    "worker": "mmserve.executor.worker_cli",
    "traces": "mmserve.clients.trace_viewer",
}


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose "unrecognized arguments" error suggests the closest flags, among
    its own and those of every subcommand registered on it (subparsers are of this class too)."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):
            hints = [self._suggestion(word) for word in message.removeprefix("unrecognized arguments: ").split()]
            message += "".join(f"\n  {hint}" for hint in hints if hint)
        super().error(message)

    def _suggestion(self, word: str) -> str | None:
        if not word.startswith("-"):
            return None
        flag = word.split("=", 1)[0]
        close = difflib.get_close_matches(flag, sorted(self._flags()), n=3, cutoff=0.6)
        return f"{flag}: did you mean {' or '.join(close)}?" if close else None

    def _flags(self) -> set[str]:
        flags = {s for action in self._actions for s in action.option_strings}
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for parser in action.choices.values():
                    flags |= {s for a in parser._actions for s in a.option_strings}
        return flags


def _add_global_flags(parser: argparse.ArgumentParser, default) -> None:
    """--log-level/--log-format: on the top level with defaults, on each subcommand without (so
    given after the subcommand they count, and absent there they leave the top level's value)."""
    parser.add_argument("--log-level", default="INFO" if default is None else default, type=str.upper,
                        choices=LOG_LEVELS, help="DEBUG, INFO, WARNING or ERROR, any case (default INFO)")
    parser.add_argument("--log-format", default="text" if default is None else default, choices=LOG_FORMATS,
                        help="text, or json: one JSON object per line with trace_id/span_id/request_id in requests")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = Parser(prog="mmserve", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"mmserve {__version__}",
                        help="print the version and exit")
    _add_global_flags(parser, None)
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    wanted = next((a for a in argv if a in SUBCOMMANDS), None)
    if wanted is None and "--version" in argv:
        return parser   # it prints and exits before any subcommand is needed: import none (serve imports torch)
    for name, module in SUBCOMMANDS.items():
        if wanted is None or name == wanted:
            importlib.import_module(module).register(sub)
    for subparser in sub.choices.values():
        _add_global_flags(subparser, argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
