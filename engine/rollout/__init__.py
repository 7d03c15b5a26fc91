"""Generation: the backends behind one interface (base.py; hf.py, vllm.py; backends.py picks one), multi-turn
rollouts (multi_turn.py) and what answers their turns: tools (tools.py, builtin_tools.py) or an
environment (envs.py, builtin_envs.py)."""

# Nothing is imported here: a tool call's or an episode's sandbox child imports engine.rollout.builtin_tools
# or builtin_envs, under an address-space cap, and must not load torch (tests/test_layers.py).
