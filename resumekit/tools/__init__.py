"""The tools: what a user runs on a checkpoint outside a training run, one module each.

Where to start reading: whichever tool is in question. :mod:`.export` consolidates a
sharded checkpoint into safetensors without a process group (public as
``resumekit.export``); :mod:`.importers` turns another tool's checkpoint into a committed
resumekit one (``import_checkpoint``); :mod:`.legacy` reads weights-only
``checkpoint_step_N`` directories (public as ``resumekit.legacy``); :mod:`.weights`
loads a checkpoint's weights into a model (``load_weights``); :mod:`.testing` is the
resume-equivalence harness for users' own trainers (public as ``resumekit.testing``).

What it may import: torch, and of resumekit the restore, state and tensors wings, the
runtime and the store below it, ``errors``, ``warnings`` and ``_optional`` (safetensors
and the other extras). Nothing above it: the manager reaches a tool, never the reverse.
"""
