"""The runtime: the processes of a job, their groups, their signals and their clocks.

Where to start reading: :mod:`.distributed` (``init_distributed``: device binding, the
checkpoint and preemption groups, ``meet``, ``shutdown``; where this process sits in the
job is read from the launcher's variables by :mod:`.launch`), then
:mod:`.preemption` (the only place that installs a signal handler: the flag, the
cross-rank vote, the emergency-save rule) and :mod:`.requeue` (what a job does after a
preemption). :mod:`.channels` pairs a process group with the coordinator and commit
protocol that use it; :mod:`.save_clock` and :mod:`.save_interval` measure what a save
costs and when the next is due; :mod:`.replicas` sends the local tier's copies between
partner ranks.

What it may import: torch and ``torch.distributed`` (not DCP's checkpoint machinery), and
of resumekit the store below it, ``errors`` and ``warnings``. Only :mod:`.preemption`
installs signal handlers (a contract in pyproject.toml).
"""
