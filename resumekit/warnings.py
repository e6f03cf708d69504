"""Warnings resumekit emits when a resume works but is not an exact replay.

A warning (not an error) is used where training can correctly go on but the resumed run
will not be bit-identical to an uninterrupted one: random streams derived for a rank the
checkpoint did not have, CUDA generator states for a different number of devices.
Filter them as a group with ``warnings.simplefilter("error", ResumekitWarning)``.
"""

from __future__ import annotations

__all__ = ["ResumekitWarning"]


class ResumekitWarning(UserWarning):
    """A resume that goes on, but differs from an uninterrupted run in the way it names."""
