"""The local tier: node-local per-rank saves, partners' replicas, a restore across tiers.

:mod:`resumekit.tiers.local` is this rank's side (its own root, the replica roots it
keeps, its local saves); :mod:`resumekit.tiers.restore_across` runs a restore across tiers on
every rank, by the decision of :mod:`resumekit.restore.tier_choice`. The manager calls both
when it has a ``LocalTier`` (``docs/local-tier.md``).

Where to start reading: :mod:`.local`. The rest of the feature lives in
``resumekit.store.local_roots`` (the directory's sub-roots and which copies a run may use),
``resumekit.runtime.replicas`` (sending copies between partners),
``resumekit.restore.tier_choice`` (the decision) and ``resumekit.cli.inspect_local``.

What it may import: of resumekit ``options`` and the wings below it, ``errors`` and
``warnings``; the layer beside it (``background``, ``save_job``, ``restore_root``) and the
manager above it never.
"""
