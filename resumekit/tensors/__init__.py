"""The tensors wing: a model's and optimizer's tensors written to and read from DCP.

It knows tensors, state dicts and DCP; it knows nothing of steps, manifests or commits: the
store hands it an empty staging directory, :func:`.save.save` fills it, :func:`.load.load`
reads a committed one back, and every rank writes only its own shards (DCP reshards on
load).

Where to start reading: :mod:`.sharded` (the names the layers above use, re-exported,
with a worked example), then :mod:`.save` (the one save path) and :mod:`.load` (the one
load path), :mod:`.state_dicts` (the views of a model and optimizer a checkpoint stores)
and :mod:`.reader` (the safe readers). :mod:`.raw` is the raw tensor format, a storage
layer under DCP with a front door of its own. docs/design.md's module table has one line
per module.

What it may import: torch, ``torch.distributed.checkpoint`` (the only wing that may, with
``_compat``: a contract in pyproject.toml), and of resumekit the runtime and the store
below it, ``errors``, ``warnings`` and ``_compat``. Every private torch name it needs is
a function of ``_compat``.
"""
