"""The store: a checkpoint root on disk or in an object store, and its atomic commits.

Torch-free. It knows step directories, manifests, checksums and who may write a root; it
knows nothing of tensors, models or training. Everything above it commits, lists, verifies,
sets aside and prunes through it.

Where to start reading: :mod:`.commit` (``CommitProtocol``; its docstring is the one
description of the commit protocol), then :mod:`.catalog` (what a root holds, and what is a
checkpoint), :mod:`.manifest` (``manifest.json``) and :mod:`.storage` (``Storage``, the
store's one door to files, over fsspec). :mod:`.layout` names every file; :mod:`.newest`,
:mod:`.targets`, :mod:`.retention`, :mod:`.recovery`, :mod:`.generations`, :mod:`.aside`,
:mod:`.foreign` and :mod:`.local_roots` each answer one question about a root;
:mod:`.coordination` is the ``Coordinator`` the protocol runs its collectives on;
:mod:`.retry` and :mod:`.tree` are helpers. docs/design.md's module table has one line each.

What it may import: the standard library, fsspec, pydantic, xxhash, and of resumekit only
``errors``, ``warnings``, ``_compat``, ``_optional`` and ``_version``; no torch and no
other wing (import-linter's contracts in pyproject.toml). The one declared exception:
``coordination.ProcessGroupCoordinator`` imports ``runtime.distributed`` and torch when it
is built, that is once a process group exists.
"""
