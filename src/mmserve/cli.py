"""`mmserve` command: a thin dispatcher; each subcommand lives beside the code it drives."""

from __future__ import annotations

import argparse
import importlib
import sys

from mmserve.logs import LOG_FORMATS, configure_logging

# subcommand -> module that defines `register(subparsers)`; imported lazily so `mmserve generate`
# never pays for torch.
SUBCOMMANDS = {
    "serve": "mmserve.server.cli",
    "generate": "mmserve.clients.cli",
    "upload": "mmserve.clients.upload_cli",
    "demo": "mmserve.clients.demo",
    "perf": "mmserve.metrics.cli",
    "demo-video": "mmserve.multimodal.synthetic",
    "eval-demo": "mmserve.clients.eval_demo",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                        help="text, or json: one JSON object per line with trace_id/span_id/request_id in requests")
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, module in SUBCOMMANDS.items():
        if wanted is None or name == wanted:
            importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
