"""The small JSON records a run reads back from storage, parsed by total functions.

Whoever can write the bucket writes these (docs/security.md), so reading one either returns a value of
the shape rlflow writes or raises `CorruptRecordError` naming the object's URL and what is wrong — never
a KeyError, a RecursionError or an OverflowError from deep inside the code that used it:

- the bytes must be UTF-8 JSON (no NaN/Infinity unless the record kind allows them, integers within
  64 bits, floats finite, nesting at most MAX_DEPTH, no lone surrogate in any string);
- the value must fit the record's model (pydantic, strict: no "5" for 5, no 1.0 for 1), each number in
  the range rlflow could have written.

The records covered by a checkpoint's MANIFEST (trainer.json) are also checked against its hash before
they are parsed (infra.checkpoints); the rest (run.json, lock.json, buffer refs, metrics, LATEST,
MANIFEST itself, update records) have only their parse to stand on.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from infra.errors import CorruptRecordError

MAX_DEPTH = 64  # a config snapshot nests 4 deep; 100k-deep JSON is an attack on the parser
MAX_INT = 2**63 - 1  # what any counter, size or step of ours fits in
_MAX_DIGITS = len(str(MAX_INT))

M = TypeVar("M", bound=BaseModel)

Count = Annotated[int, Field(ge=0, le=MAX_INT)]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Text = Annotated[str, Field(max_length=4096)]


class _Refused(ValueError):
    """Raised from inside json.loads' hooks: the record holds a value no rlflow writer makes."""


def load_json(data: bytes, url: str, *, allow_nan: bool = False) -> Any:
    """The JSON value of a stored record; CorruptRecordError naming `url` for anything else."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CorruptRecordError(f"{url} is not UTF-8 text (byte {err.start} is {data[err.start]:#04x})") from None
    try:
        value = json.loads(text, parse_int=_int, parse_float=lambda s: _float(s, allow_nan),
                           parse_constant=lambda s: _constant(s, allow_nan))
    except RecursionError:
        raise CorruptRecordError(f"{url} nests deeper than {MAX_DEPTH} levels") from None
    except _Refused as err:
        raise CorruptRecordError(f"{url} holds {err}") from None
    except ValueError as err:
        raise CorruptRecordError(f"{url} is not JSON ({err})") from None
    _check_tree(value, url)
    return value


def parse_record(model: type[M], data: bytes, url: str, what: str, *, allow_nan: bool = False) -> M:
    """`data` as a `model` record (strict types, the model's ranges); CorruptRecordError naming `url`,
    the field and the problem otherwise."""
    value = load_json(data, url, allow_nan=allow_nan)
    try:
        # JSON mode: an array is a tuple, and strict still refuses "5" for 5 and 1.0 for an int.
        return model.model_validate_json(json.dumps(value, allow_nan=allow_nan), strict=True)
    except ValidationError as err:
        raise CorruptRecordError(f"{url} is not a valid {what}: {describe(err)}") from None


def check_record(model: type[M], data: bytes, url: str, what: str) -> dict[str, Any]:
    """`data`'s JSON object as stored (keys and values untouched: a signature over it still holds), once it
    has passed `parse_record` as a `model`."""
    parse_record(model, data, url, what)
    value = load_json(data, url)
    assert isinstance(value, dict)  # the model is an object
    return value


def describe(err: ValidationError) -> str:
    """The first problem of a ValidationError on one line: `files.0.size: Input should be ... (and 2 more)`."""
    first = err.errors(include_url=False)[0]
    where = ".".join(str(p) for p in first["loc"]) or "the top level"
    more = err.error_count() - 1
    return f"{where}: {first['msg']}" + (f" (and {more} more)" if more else "")


def _int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_DIGITS or abs(value := int(text)) > MAX_INT:
        raise _Refused(f"an integer out of range ({text[:24]}{'...' if len(text) > 24 else ''})")
    return value


def _float(text: str, allow_nan: bool) -> float:
    value = float(text)
    if not allow_nan and not math.isfinite(value):
        raise _Refused(f"a number out of range ({text[:24]})")
    return value


def _constant(text: str, allow_nan: bool) -> float:
    if not allow_nan:
        raise _Refused(f"a non-finite number ({text})")
    return float(text)


def _check_tree(value: Any, url: str) -> None:
    """Depth and strings, without recursion (the value may be as deep as json.loads allowed)."""
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise CorruptRecordError(f"{url} nests deeper than {MAX_DEPTH} levels")
        if isinstance(item, str):
            _check_text(item, url)
        elif isinstance(item, dict):
            for key, inner in item.items():
                _check_text(key, url)
                pending.append((inner, depth + 1))
        elif isinstance(item, list):
            pending.extend((inner, depth + 1) for inner in item)


def _check_text(text: str, url: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise CorruptRecordError(f"{url} holds a string with a lone surrogate ({text[:24]!r})") from None


# ======================================================================= the records

class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow", allow_inf_nan=False)


class ParentRecord(_Record):
    """run.json's `parent`: the run and checkpoint a run started from (flows/deploy.py)."""

    run_id: Text
    step: Count
    checkpoint: Text
    model_path: Text | None = None


class BaseModelRecord(_Record):
    """run.json's `base_model` (engine.models.loading.model_identity)."""

    path: Text
    sha256: Sha256


class ConfigSnapshot(_Record):
    """run.json's `config`: what `--resume` reads before validating the whole config (flows/plan.py)."""

    model: dict[str, Any] = Field(default_factory=dict)


class RunInfoRecord(_Record):
    """run.json (infra.runs.RunStore.write_run_info)."""

    run_id: Text
    created: Text
    config: ConfigSnapshot
    code_version: Text | None = None
    parent: ParentRecord | None = None
    config_hash: Text | None = None
    base_model: BaseModelRecord | None = None


class LeaseRecord(_Record):
    """lock.json (infra.runs.Lease)."""

    run_id: Text
    token: Text
    host: Text
    pid: Annotated[int, Field(ge=0, le=2**31 - 1)]
    since: Text
    renewed: Text
    expires_at: Annotated[float, Field(ge=0, le=1e12)]
    expires: Text
    generation: Count
    released: bool


class TrainerStateRecord(_Record):
    """trainer.json of a checkpoint (flows/train.py Trainer.trainer_state)."""

    iteration: Count
    kl_ctrl: dict[str, Annotated[float, Field(ge=0, le=1e12)]] = Field(default_factory=dict)  # the KL coefficient


def parse_metrics(data: bytes, url: str, iteration: int | None = None) -> dict[str, float | int | bool | None]:
    """A metrics object: metrics/iter_N.json (infra.runs.RunStore.write_metrics; `iteration` equal to its
    file's) or an update record (buffers/iter_N/update_<role>.json). Every value a number (NaN allowed: a
    metric may be undefined on an iteration) or null."""
    record = load_json(data, url, allow_nan=True)
    if not isinstance(record, dict):
        raise CorruptRecordError(f"{url} is not a valid metrics record: not a JSON object")
    if iteration is not None and (type(found := record.get("iteration")) is not int or found != iteration):
        raise CorruptRecordError(f"{url} is not a valid metrics record: iteration is {record.get('iteration')!r}, "
                                 f"its name says {iteration}")
    for key, value in record.items():
        if value is not None and type(value) not in (int, float, bool):
            raise CorruptRecordError(f"{url} is not a valid metrics record: {key[:60]!r} is a {type(value).__name__}, "
                                     "not a number")
    return record
