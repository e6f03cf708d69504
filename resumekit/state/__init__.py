"""The state wing: what a checkpoint holds besides a model's and optimizer's tensors.

Where to start reading: :mod:`.train_state` (``TrainState``: what a checkpoint holds and
how it is split into files: the tensors through the tensors wing, the rest as small files
per checkpoint and per rank). Each kind of state has its module: :mod:`.rng` (every random
stream of one rank), :mod:`.loader` (a ``DataLoader``'s resumable position),
:mod:`.sampler` (``ResumableDistributedSampler``, a data position that survives a change
of world size) and :mod:`.jsonable` (user data for the manifest, checked early).

What it may import: torch, and of resumekit the tensors wing, the runtime and the store
below it, ``errors`` and ``warnings``. DCP only through the tensors wing, except DCP's
public state-dict API for the parameter fingerprint (a declared exception in
pyproject.toml).
"""
