"""Seeds derived from (run seed, iteration, stage, rank), so a replayed stage draws the same numbers."""

from __future__ import annotations

import hashlib


def derive_seed(run_seed: int, iteration: int, stage: str, rank: int = 0) -> int:
    """A 63-bit seed that depends only on its arguments (not on process, order or time)."""
    key = f"{run_seed}/{iteration}/{stage}/{rank}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & (2**63 - 1)
