"""Generation: the backends behind one interface (base.py; hf.py, vllm.py; backends.py picks one), multi-turn
rollouts (multi_turn.py) and the tools they call (tools.py, builtin_tools.py)."""

# Nothing is imported here: a tool call's sandbox child imports engine.rollout.builtin_tools, under an
# address-space cap, and must not load torch (tests/test_layers.py).
