"""`rlflow infra s3 [--port P] [--bucket B]`: a local S3 protocol server for development."""

from __future__ import annotations

import argparse

from infra import s3server


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("infra", help="local services for development")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    s3 = verbs.add_parser(
        "s3",
        help="run a local S3 server (moto) on 127.0.0.1 until Ctrl-C",
        description="Run moto's S3 server on loopback, create a bucket, and print the endpoint and the "
        "environment variables to export. State is in memory: it is gone when the server stops.",
    )
    s3server.add_arguments(s3)
    s3.set_defaults(func=s3server.run_from_args)
