"""The project's own tiny models, synthetic tasks and their warm starts (tiny.py, families.py, tiny_rm.py,
synthetic.py, data.py): flows/ and the CLI call them; nothing else in engine/ imports them."""
