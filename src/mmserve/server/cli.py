"""`mmserve serve`: run the gRPC server (the embedded demo model unless --model names another).

Every EngineConfig and ServerConfig field is a flag and an MMSERVE_* environment variable.
Exits 0 after a clean drain on SIGTERM/SIGINT (also when the signal came during start-up), 1 when the
drain had to cut streams off or the server could not start (bad TLS/key files, port in use, an engine
that failed to load or to get ready within --engine-ready-timeout-s), 2 when a flag's value is invalid,
flags conflict (--max-frames-per-request below the frames a video gets by default) or the checkpoint
directory is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from mmserve.config import EngineConfig, ServerConfig, add_dataclass_args, from_args
from mmserve.errors import MMServeError
from mmserve.process_exit import exit_process
from mmserve.server import openai_gateway
from mmserve.server.auth import load_api_keys

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over gRPC", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    server = p.add_argument_group("server")
    add_dataclass_args(server, ServerConfig)
    engine = p.add_argument_group("engine")
    add_dataclass_args(engine, EngineConfig)
    p.set_defaults(func=run)


def missing_checkpoint(model: str) -> str:
    """Why --model is not a checkpoint, and what to do; a Hub id (`org/name`) gets the download hint,
    since this server reads local folders only and downloads nothing."""
    message = f"no checkpoint at {model} (config.json is missing); pass --model DIR, a checkpoint folder"
    path = Path(model)
    if not path.exists() and len(path.parts) == 2 and not model.startswith((".", "/", "~")):
        message += (f". {model!r} looks like a Hugging Face Hub id: this server downloads nothing. Fetch it "
                    f"where the Hub is reachable, `huggingface-cli download {model} --local-dir DIR` (copy DIR "
                    "here if need be), then --model DIR (README.md, 'Serving a real Gemma 4')")
    return message


def _has_api_keys(config: ServerConfig) -> bool:
    if not config.openai_port:
        return False
    try:
        return bool(load_api_keys(config.api_keys_file))
    except ValueError:   # an unreadable keys file: serve() refuses to start, naming it
        return False


def run(args: argparse.Namespace) -> int:
    try:
        engine_config, server_config = from_args(EngineConfig, args), from_args(ServerConfig, args)
    except ValueError as e:   # flags valid alone that conflict (EngineConfig.__post_init__)
        logger.error("mmserve serve: %s", e)
        return 2
    if not (Path(engine_config.model) / "config.json").is_file():
        logger.error("%s", missing_checkpoint(engine_config.model))
        return 2
    if why := openai_gateway.refusal(server_config, api_keys=_has_api_keys(server_config)):
        logger.error("%s", why)
        return 2
    from mmserve.server.kv_event_publisher import KvEventsConfig

    try:
        KvEventsConfig.parse(server_config.kv_events_config)
    except ValueError as e:
        logger.error("mmserve serve: %s", e)
        return 2
    from mmserve.server.app import serve  # torch and the model stack load only when really serving

    try:
        code = 0 if asyncio.run(serve(engine_config, server_config)) else 1
    except (OSError, ValueError, MMServeError) as e:  # bad flags, files or ports, a dead engine: a message, not a traceback
        logger.error("mmserve serve: %s", e, exc_info=logger.isEnabledFor(logging.DEBUG))
        code = 1
    # serve() has returned or raised through its own cleanup: the gRPC server stopped, the engine process
    # joined, the media spool, the KV publisher and the exporters closed. Skip the interpreter's second
    # of module teardown (mmserve/process_exit.py).
    exit_process(code)
