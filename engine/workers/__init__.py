"""The Ray side of the engine: worker groups of ranks (group.py) and the ranks themselves, each a Ray actor
(base.py; policy.py, critic.py, rollout_worker.py, reward_model_worker.py), sharded with FSDP2 (fsdp.py)."""
