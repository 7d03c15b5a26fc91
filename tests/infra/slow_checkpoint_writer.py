"""Writes a checkpoint slowly, shard by shard, printing progress: the victim of the SIGKILL test.

    python slow_checkpoint_writer.py ROOT RUN_ID STEP SHARDS SHARD_BYTES DELAY_S
"""

from __future__ import annotations

import os
import sys
import time

from infra.checkpoints import CheckpointStore
from infra.store import ObjectStore

root, run_id, step, shards, size, delay = sys.argv[1:7]
ckpts = CheckpointStore(ObjectStore(root), run_id)
ckpts.begin(int(step))
for i in range(int(shards)):
    ckpts.write_bytes(int(step), f"policy/__{i}_0.distcp", os.urandom(int(size)))
    print(f"shard {i}", flush=True)
    time.sleep(float(delay))
ckpts.commit(int(step))
print("committed", flush=True)
