"""``python -m resumekit``: the command line (see :mod:`resumekit.cli`)."""

from resumekit.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
