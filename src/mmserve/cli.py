"""`mmserve` command: a thin dispatcher; each subcommand lives beside the code it drives."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

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
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, module in SUBCOMMANDS.items():
        if wanted is None or name == wanted:
            importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
