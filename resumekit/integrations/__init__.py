"""Adapters for training frameworks, each optional.

Importing ``resumekit`` imports none of them, and none imports its framework until its
own module is imported:

* :mod:`resumekit.integrations.lightning`: ``ResumekitCheckpointIO``, a Lightning
  ``CheckpointIO`` plugin writing every checkpoint as a resumekit atomic commit, and
  ``ResumekitCallback``: per-rank RNG streams, the data position, the agreed emergency
  save with exit 75 on SIGTERM/SIGUSR1, ``ckpt_path="last"`` and a fine-tune's start.
* :mod:`resumekit.integrations.torchtitan`: ``ResumekitCheckpointer``, the checkpointer
  torchtitan's trainer builds from ``checkpoint=ResumekitCheckpointer.Config(...)`` (one
  line of its config) in place of its own ``CheckpointManager``.

Accelerate needs no adapter (``CheckpointManager`` takes what ``accelerator.prepare()``
returns) and the Hugging Face ``Trainer`` cannot have one (its callbacks run after its
own save); ``docs/integrations.md`` shows both recipes.

Where to start reading: the adapter of the framework in question.

What it may import: every layer of resumekit below it (it is the top layer, beside
``cli``), and its framework only inside its own module.
"""
