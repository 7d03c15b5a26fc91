"""A local S3 protocol server for development and tests: moto's S3 on 127.0.0.1.

    python -m infra.s3server --port 9000 --bucket rlflow      # or: rlflow infra s3

Two things are added to moto's server so that it behaves like S3 where rlflow relies on it:

- **Credentials are checked.** moto accepts any key by default, so "bad credentials fail at once"
  could not be tested. Here one IAM user with full S3 access is created at start with the dev key
  pair (fixed defaults, or given), and signature checking is switched on: a wrong key gets 403
  InvalidAccessKeyId, a wrong secret 403 SignatureDoesNotMatch, as on AWS. These are throw-away
  credentials of a loopback server, which is why this module — and only it — prints them.
- **Conditional writes are atomic.** moto checks `If-None-Match` / `If-Match` and then stores the
  object in two steps, so two racing conditional PUTs could both succeed. Requests that carry a
  precondition are serialised here; S3 itself guarantees this, and the writer lease depends on it.

The state lives in memory: it is gone when the server stops.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

DEV_ACCESS_KEY_ID = "AKIARLFLOWDEVKEY0000"
DEV_SECRET_ACCESS_KEY = "rlflow-dev-secret-not-for-production"
DEV_REGION = "us-east-1"

_ADMIN_POLICY = json.dumps(
    {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
)

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _SerialiseConditionalWrites:
    """WSGI middleware: one request with a precondition header at a time (see the module docstring)."""

    def __init__(self, app: WSGIApp) -> None:
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        conditional = environ.get("REQUEST_METHOD") in ("PUT", "POST", "DELETE") and (
            "HTTP_IF_NONE_MATCH" in environ or "HTTP_IF_MATCH" in environ
        )
        if not conditional:
            return self.app(environ, start_response)
        with self.lock:
            # Drain the response inside the lock: moto does its work while producing it.
            return list(self.app(environ, start_response))


def _enable_auth(access_key_id: str, secret_access_key: str) -> None:
    """Create one admin IAM user owning the given key pair and make moto verify every signature."""
    from moto import settings
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.iam.models import iam_backends

    iam = iam_backends[DEFAULT_ACCOUNT_ID]["aws"]
    iam.create_user(region_name=DEV_REGION, user_name="rlflow-dev")
    key = iam.create_access_key("rlflow-dev")
    # moto generates random keys; the lookup scans users' keys by id, so setting both is enough.
    key.access_key_id = access_key_id
    key.secret_access_key = secret_access_key
    iam.put_user_policy("rlflow-dev", "admin", _ADMIN_POLICY)
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0


def make_app(access_key_id: str = DEV_ACCESS_KEY_ID, secret_access_key: str = DEV_SECRET_ACCESS_KEY,
             auth: bool = True) -> WSGIApp:
    """moto's S3 as a WSGI app, with credential checking (unless auth=False) and atomic preconditions."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

    if auth:
        _enable_auth(access_key_id, secret_access_key)
    return _SerialiseConditionalWrites(DomainDispatcherApplication(create_backend_app))


def create_bucket(endpoint_url: str, bucket: str, access_key_id: str = DEV_ACCESS_KEY_ID,
                  secret_access_key: str = DEV_SECRET_ACCESS_KEY, region: str = DEV_REGION) -> None:
    """Create `bucket` on the server at `endpoint_url` (no error when it exists)."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint_url, region_name=region,
                          aws_access_key_id=access_key_id, aws_secret_access_key=secret_access_key)
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass


def env_for(endpoint_url: str, access_key_id: str = DEV_ACCESS_KEY_ID,
            secret_access_key: str = DEV_SECRET_ACCESS_KEY, region: str = DEV_REGION) -> dict[str, str]:
    """The standard AWS environment variables that point a client at this server."""
    return {
        "AWS_ENDPOINT_URL": endpoint_url,
        "AWS_ACCESS_KEY_ID": access_key_id,
        "AWS_SECRET_ACCESS_KEY": secret_access_key,
        "AWS_DEFAULT_REGION": region,
    }


def serve(host: str = "127.0.0.1", port: int = 9000, bucket: str | None = "rlflow",
          access_key_id: str = DEV_ACCESS_KEY_ID, secret_access_key: str = DEV_SECRET_ACCESS_KEY,
          auth: bool = True, verbose: bool = False, out: Any = None) -> None:
    """Run the server until SIGINT/SIGTERM. Port 0 picks a free one; the first line printed is
    `endpoint <url>` so that a parent process can read it."""
    from moto.moto_server.werkzeug_app import MotoRequestHandler
    from werkzeug.serving import make_server

    out = out or sys.stdout
    logging.getLogger("werkzeug").setLevel(logging.INFO if verbose else logging.WARNING)
    app = make_app(access_key_id, secret_access_key, auth=auth)
    server = make_server(host, port, app, threaded=True, request_handler=MotoRequestHandler)
    endpoint = f"http://{host}:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    if bucket:
        create_bucket(endpoint, bucket, access_key_id, secret_access_key)
    print(f"endpoint {endpoint}", file=out)
    print("export " + " ".join(f"{k}={v}" for k, v in env_for(endpoint, access_key_id,
                                                              secret_access_key).items()), file=out)
    if bucket:
        print(f"storage root: s3://{bucket}/runs   (rlflow train storage.root=s3://{bucket}/runs)", file=out)
    print("in-memory: everything is gone when it stops; Ctrl-C to stop", file=out, flush=True)

    def _stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)  # also when started in the background with SIGINT ignored
    try:
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    parser.add_argument("--port", type=int, default=9000, help="port (0: a free one; default 9000)")
    parser.add_argument("--bucket", default="rlflow", help="bucket created at start ('' for none)")
    parser.add_argument("--access-key-id", default=DEV_ACCESS_KEY_ID, help="the dev key id accepted")
    parser.add_argument("--secret-access-key", default=DEV_SECRET_ACCESS_KEY, help="its dev secret")
    parser.add_argument("--no-auth", action="store_true", help="accept any credentials (moto's default)")
    parser.add_argument("--verbose", action="store_true", help="log every request")


def run_from_args(args: argparse.Namespace) -> int:
    try:
        import moto  # noqa: F401
    except ImportError:
        from infra.errors import InfraError

        raise InfraError("rlflow infra s3 runs moto's S3 server, which the main install leaves out: "
                         "pip install -c constraints-cpu.txt -e '.[s3]'") from None
    serve(host=args.host, port=args.port, bucket=args.bucket or None, access_key_id=args.access_key_id,
          secret_access_key=args.secret_access_key, auth=not args.no_auth, verbose=args.verbose)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.s3server", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
