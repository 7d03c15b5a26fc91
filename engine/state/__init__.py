"""Training state on the move: a rank's checkpoint shards to and from storage (checkpoint_io.py) and split
placement's bucketed weight broadcast from the training pool to the rollout ranks (weight_sync.py)."""
