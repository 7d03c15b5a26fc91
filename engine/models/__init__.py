"""Models: where a causal LM comes from and how it loads (loading.py), prompts to tokens and responses to
text (tokens.py), LoRA adapters (lora.py). Nothing is imported here: import the module you need."""
