"""A small-scale re-creation of the LingBot-VA video-action training recipe.

Modules:
    config: typed configs (``tiny`` for CPU tests, ``furniture_all_e128`` at real size).
    model: the Wan-style video-action transformer and its FSDP2 sharding helper.
    data: a deterministic synthetic dataset, an episode-directory loader and ``collate``.
    recipe: flow-matching losses, AdamW and the warm-up schedule.
"""
