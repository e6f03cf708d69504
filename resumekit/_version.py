"""The package version: ``pyproject.toml`` says the same, and docs/versions.md when it moves.

Every manifest records it (``versions.resumekit``); ``resumekit --version`` and
``resumekit inspect`` show it. ``tests/unit/test_one_version.py`` keeps the places that say
it, and the releases the code and the docs name, in step with it.
"""

__version__ = "0.3.0"
