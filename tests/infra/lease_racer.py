"""Races for run leases (the other racer is a second process): prints `<round> won|refused`.

    python lease_racer.py ROOT RUN_PREFIX ROUNDS T0 GAP_S

Round r starts at wall-clock time T0 + r * GAP_S on run `<RUN_PREFIX>-<r>`, so both processes try
at the same instant. Leases are kept (not released) so the loser must see them held.
"""

from __future__ import annotations

import sys
import time

from infra.errors import LeaseError
from infra.runs import RunStore
from infra.store import ObjectStore

root, prefix, rounds, t0, gap = sys.argv[1:6]
store = ObjectStore(root)
held = []
for r in range(int(rounds)):
    time.sleep(max(0.0, float(t0) + r * float(gap) - time.time()))
    try:
        held.append(RunStore(store, f"{prefix}-{r}").acquire_lease(ttl_s=60))
        print(f"{r} won", flush=True)
    except LeaseError as err:
        print(f"{r} refused {err}", flush=True)
