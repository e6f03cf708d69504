"""Benchmarks of resumekit against its peers and against the machine's own limits.

Run ``make bench`` (or ``python -m benchmarks.run``). Every reported figure is a ratio of
two methods measured side by side in the same run, interleaved round by round
(A B A B ...), median of several rounds: absolute wall-clock numbers on a shared machine
drift too much to be compared across runs. See ``docs/performance.md``.
"""
