"""Prompt data: datasets in verl's layout, loaded and checked row by row (prompts.py), and the sampler
that orders them into batches, epoch after epoch (sampler.py)."""
