"""The local tier, one package: node-local per-rank saves, replicas, a restore across tiers.

* :mod:`.site`: :class:`~resumekit.local.site.LocalSite`, this rank's side: its own root,
  the replica roots its node keeps, its local saves (committed by
  :func:`resumekit.save_job.write_step`, the commit sequence of every tier), the survey of
  usable copies and the deletion of those a restore leaves.
* :mod:`.saves`: :class:`~resumekit.local.saves.LocalSaves`, the local saves staged in
  ``step_end`` and written, committed and replicated on a thread and a process group of
  their own.
* :mod:`.replicas`: peer replicas, each rank's copies sent to a partner on another node.
* :mod:`.roots`: the tier's directory (its sub-roots) and which copies a run may use; no
  torch (``resumekit inspect`` reads local roots).
* :mod:`.tier_choice`: which tier a restore reads (the decision only; no torch).
* :mod:`.restore_across`: a restore across tiers run on every rank by that decision.

The tier's options are :class:`resumekit.options.LocalTier` (``resumekit.LocalTier``, with
the manager's other knobs), and ``resumekit inspect`` of a local root is
:mod:`resumekit.cli.inspect_local` (the command line's). The manager holds a ``LocalSite``
and a ``LocalSaves`` when it has a ``LocalTier`` (``docs/local-tier.md``). This front door
imports nothing, so that the torch-free modules stay torch-free to import.

Where to start reading: :mod:`.site`.

What it may import: of resumekit ``background``, ``restore_root``, ``save_job`` and the
wings below them (options, tools, restore, state, tensors, runtime, store), ``errors`` and
``warnings``; the manager and the command line above it never.
"""
