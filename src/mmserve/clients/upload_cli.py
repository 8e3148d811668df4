"""`mmserve upload FILE`: upload a video or image to a server and print its media id.

The id (the sha256 of the file's bytes) then names the media in requests to the same server, e.g.
`Video.media_id` with grpcurl. A progress bar shows on a terminal. Exits 2 for a bad request (or a
missing file), 1 for any other failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import grpc

from mmserve.clients.cli import add_connection_args, connect
from mmserve.clients.types import ClientError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("upload", help="upload a video/image file to a server and print its media id",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_connection_args(p)
    p.add_argument("file", type=Path, help="the video or image file")
    p.add_argument("--mime-type", default="", help="e.g. video/mp4; empty = the server sniffs it when used")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print id, size_bytes, mime_type and ttl_s as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.file.is_file():
        print(f"mmserve upload: no such file: {args.file}", file=sys.stderr)
        return 2
    with connect(args) as client:
        try:
            ref = client.upload(args.file, mime_type=args.mime_type, progress=not args.no_progress)
        except ClientError as e:
            print(f"mmserve upload: {e.code.name}: {e.message}", file=sys.stderr)
            return 2 if e.code == grpc.StatusCode.INVALID_ARGUMENT else 1
    if args.json:
        print(json.dumps({k: v for k, v in dataclasses.asdict(ref).items() if k != "source"}))
    else:
        print(ref.id)
    return 0
