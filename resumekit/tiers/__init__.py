"""The local tier: node-local per-rank saves, partners' replicas, a restore across tiers.

:mod:`resumekit.tiers.local` is this rank's side (its own root, the replica roots it
keeps, its local saves); :mod:`resumekit.tiers.restore` runs a restore across tiers on
every rank, by the decision of :mod:`resumekit.restore.tiers`. The manager calls both
when it has a ``LocalTier`` (``docs/local-tier.md``).
"""
