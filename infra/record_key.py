"""The record key: run.json is signed with a key the launching user holds and the bucket does not.

Whoever can write the bucket can rewrite run.json. A resumed run takes its settings from run.json only
when the record carries a valid signature made with this key (HMAC-SHA256 over the run id and the
record's canonical JSON); otherwise every stored setting must equal what the user gives, and one that
differs is refused (flows/plan.py, docs/security.md).

The key: $RLFLOW_RECORD_KEY (64 or more hex digits), else the file `record_key` in the state folder
($RLFLOW_HOME, default ~/.rlflow), 256 random bits made once with mode 0600. Another machine that
resumes the same runs needs the same key (copy the file, or set the variable from a secret store).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

from infra.errors import InfraError

ENV = "RLFLOW_RECORD_KEY"
FILE = "record_key"
SIGNATURE = "signature"  # run.json's field that holds it
_ALG = "hmac-sha256"
_DOMAIN = b"rlflow run.json v1\0"


def record_key() -> bytes:
    """This user's record key, made in the state folder on first use."""
    from infra.stack import ensure_secret_file, private_temp_dir, resolve_home

    return _from_env() or _read(ensure_secret_file(private_temp_dir(resolve_home(), "the state folder", parents=True)
                                                   / FILE, "the record key"))


def existing_record_key() -> bytes | None:
    """This user's record key, or None when there is none yet (nothing is made)."""
    from infra.stack import resolve_home

    path = resolve_home() / FILE
    return _from_env() or (_read(path) if path.exists() else None)


def _from_env() -> bytes | None:
    text = os.environ.get(ENV)
    if text is None:
        return None
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) < 32:
        raise InfraError(f"${ENV} must be 64 or more hex digits (256 bits); it is not (its value is not shown)")
    return key


def _read(path: Path) -> bytes:
    try:
        key = bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError) as err:
        raise InfraError(f"the record key {path} cannot be read as hex ({err}); remove it to make a new one "
                         "(runs signed with the old key then resume only with their config given again)") from None
    if len(key) < 32:
        raise InfraError(f"the record key {path} is shorter than 256 bits; remove it to make a new one")
    return key


def key_id(key: bytes) -> str:
    """A short public name of a key, for messages: which key signed a record (never the key)."""
    return hashlib.sha256(b"rlflow key id\0" + key).hexdigest()[:12]


def _mac(key: bytes, run_id: str, info: dict[str, Any]) -> str:
    body = {k: v for k, v in info.items() if k != SIGNATURE}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    message = _DOMAIN + run_id.encode() + b"\0" + canonical.encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign(info: dict[str, Any], run_id: str, key: bytes) -> dict[str, Any]:
    """`info` with its signature field set (every other field covered, the run id bound in)."""
    signed = {k: v for k, v in info.items() if k != SIGNATURE}
    signed[SIGNATURE] = {"alg": _ALG, "key_id": key_id(key), "mac": _mac(key, run_id, signed)}
    return signed


def verify(info: dict[str, Any], run_id: str, key: bytes | None) -> str | None:
    """None when `info` is signed for `run_id` with `key`; else why not, in a few words (for a message)."""
    found = info.get(SIGNATURE)
    if not isinstance(found, dict) or not isinstance(found.get("mac"), str):
        return "it is not signed"
    if key is None:
        return "there is no record key here to check its signature with"
    if found.get("key_id") != key_id(key):
        return f"it is signed with another key (id {str(found.get('key_id'))[:12]!r}, yours is {key_id(key)!r})"
    if not hmac.compare_digest(found["mac"], _mac(key, run_id, info)):
        return "its signature does not match its contents"
    return None
