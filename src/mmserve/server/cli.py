"""`mmserve serve`: run the gRPC server (the embedded demo model unless --model names another).

Every EngineConfig and ServerConfig field is a flag and an MMSERVE_* environment variable.
Exits 0 after a clean drain on SIGTERM/SIGINT, 1 when the drain had to cut streams off.
"""

from __future__ import annotations

import argparse
import asyncio

from mmserve.config import EngineConfig, ServerConfig, add_dataclass_args, from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over gRPC", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    server = p.add_argument_group("server")
    add_dataclass_args(server, ServerConfig)
    engine = p.add_argument_group("engine")
    add_dataclass_args(engine, EngineConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mmserve.server.app import serve

    clean = asyncio.run(serve(from_args(EngineConfig, args), from_args(ServerConfig, args)))
    return 0 if clean else 1
