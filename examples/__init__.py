"""Runnable examples of resumekit (``python -m examples.<name>.<script>``)."""
