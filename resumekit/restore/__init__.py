"""The restore wing: the decisions a restore makes, apart from the code that runs them.

Where to start reading: :mod:`.plan` (what a restore does with each entry of a root:
candidates, refusals, what a failed load means, leftovers, why a run starts at step 0;
no torch, no collectives), then :mod:`.entries` (running those decisions on a root),
:mod:`.verification` (which rank checks which file, and ``.metadata`` read once),
:mod:`.compatibility` (whether a checkpoint fits the run) and :mod:`.tier_choice` (which tier a
restore across tiers reads; no torch). The restore that runs them, on every rank, is
``resumekit.restore_root.RootRestore`` one layer up.

What it may import: of resumekit the state and tensors wings, the runtime and the store
below it, ``errors`` and ``warnings``. :mod:`.plan` and :mod:`.tier_choice` import no torch
(contracts in pyproject.toml), so they are tested without a process or a model.
"""
