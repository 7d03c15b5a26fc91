"""Errors of the storage and service layer. The CLI prints these as one line, without a traceback."""


class InfraError(Exception):
    """A user-facing storage or service error; the message names the object and what went wrong."""


class StoreError(InfraError):
    """A permanent object-store failure (no such bucket, access denied, corrupt object)."""


class LeaseError(InfraError):
    """Another writer holds the run's lease."""


class IntegrityError(StoreError):
    """Stored content does not match its recorded hash or size."""


class ObjectNotFound(StoreError, FileNotFoundError):
    """A required object does not exist (404). Also a FileNotFoundError, for `except` convenience."""


class StoreUnavailable(StoreError):
    """A transient failure (connection, timeout, 5xx, throttling) outlasted every retry."""


class CorruptRecordError(IntegrityError):
    """A stored record (run.json, lock.json, a buffer's ref, metrics, trainer.json, MANIFEST.json, LATEST)
    is not what rlflow writes: not UTF-8, not JSON, a wrong type, a number out of range. The message names
    the object's URL and what is wrong (infra.records)."""
