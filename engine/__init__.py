"""The engine: models, rollouts, algorithms and the workers that run them."""

from engine import _dists

_dists.install()  # before anything imports transformers: see engine/_dists.py
