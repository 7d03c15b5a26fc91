"""The project's own tiny models, synthetic tasks and their warm starts (tiny.py, families.py, tiny_rm.py,
synthetic.py, data.py; folders.py, progress.py): flows/ and the CLI call them; nothing else imports them."""
