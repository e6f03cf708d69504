"""The public module path ``resumekit.testing``.

The resume-equivalence harness for users' own trainers. The code lives in
``resumekit.tools.testing`` (docs/design.md); this path is kept for good.
"""

from resumekit.tools.testing import (
    EquivalenceReport,
    Interruption,
    Probe,
    check_resume_equivalence,
    crash_after,
    flat_state,
    stop_after,
)

__all__ = [
    "EquivalenceReport",
    "Interruption",
    "Probe",
    "check_resume_equivalence",
    "crash_after",
    "flat_state",
    "stop_after",
]
