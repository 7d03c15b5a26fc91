"""Errors the engine raises for bad input. The CLI prints these as one line, without a traceback."""


class RLFlowError(Exception):
    """A user-facing error: the message names the input and what is allowed."""


class ConfigError(RLFlowError):
    """A config value is unknown, of the wrong type or out of range."""


class DataError(RLFlowError):
    """A dataset file or row is malformed."""


class RewardError(RLFlowError):
    """A reward function raised, or returned something that is not a finite number."""


class EngineError(RLFlowError):
    """A worker rank failed, hung past its timeout, or refused a call (version or config mismatch)."""


class EngineDeadError(EngineError):
    """A worker rank is gone (its process died); the engine must be recreated and restored."""


class EngineHungError(EngineDeadError):
    """A worker rank made no progress within its call's timeout (stopped, or stuck in a collective with
    one that is): the engine is recreated and restored as if the rank had died."""


class VersionMismatchError(EngineError):
    """A stage expected the engine at one version (iteration) and found another."""


class NonFiniteError(EngineError):
    """A loss, advantage or gradient is NaN or infinite: the iteration fails with its reason (no optimizer
    step is taken with it, and no retry would compute anything else)."""
