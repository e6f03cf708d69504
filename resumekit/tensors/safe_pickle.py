"""A restricted unpickler for the few pickles a checkpoint contains.

DCP writes its ``.metadata`` file with :mod:`pickle`. Unpickling runs whatever callable the
file names, so a checkpoint downloaded from elsewhere (or tampered with on shared storage)
could execute code the moment anyone *inspects* it. :func:`load_dcp_metadata` reads that
file with an allow-list instead: the DCP metadata dataclasses, ``torch.Size``, the torch
dtypes and layouts and ``pathlib`` paths. Anything else is refused with
:class:`~resumekit.errors.UnsafeCheckpointError` naming the file and the global, before the
global is even imported.

The allow-list is deliberately exact (module *and* name): allowing "anything from torch"
would allow ``torch.load`` and ``torch.hub``.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterable
from typing import IO, Any

import torch

from resumekit.errors import (
    CorruptCheckpointError,
    UnreadableFormatError,
    UnsafeCheckpointError,
)

__all__ = [
    "DCP_METADATA_GLOBALS",
    "RestrictedUnpickler",
    "load_dcp_metadata",
    "restricted_loads",
]

_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_DCP_FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"


def _torch_dtype_globals() -> frozenset[tuple[str, str]]:
    names = [name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)]
    return frozenset(("torch", name) for name in names)


DCP_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP_METADATA_MODULE, "Metadata"),
        (_DCP_METADATA_MODULE, "MetadataIndex"),
        (_DCP_METADATA_MODULE, "StorageMeta"),
        (_DCP_METADATA_MODULE, "TensorStorageMetadata"),
        (_DCP_METADATA_MODULE, "BytesStorageMetadata"),
        (_DCP_METADATA_MODULE, "ChunkStorageMetadata"),
        (_DCP_METADATA_MODULE, "TensorProperties"),
        (_DCP_METADATA_MODULE, "_MEM_FORMAT_ENCODING"),
        (_DCP_FILESYSTEM_MODULE, "_StorageInfo"),
        ("torch", "Size"),
        # torch pickles a layout (``torch.strided``) as a call of this name -> layout lookup.
        ("torch.serialization", "_get_layout"),
        # ``StorageMeta.checkpoint_id`` is the path the checkpoint was saved to.
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "PurePosixPath"),
        ("pathlib._local", "WindowsPath"),
        ("pathlib._local", "PureWindowsPath"),
    }
) | _torch_dtype_globals()
"""Every ``(module, name)`` global a DCP ``.metadata`` pickle may reference."""


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only globals on an explicit allow-list.

    Persistent ids (the mechanism ``torch.save`` uses for tensor storages) are refused too,
    so the only callables a pickle can reach are the allowed ones.

    Args:
        file: A binary stream positioned at the start of the pickle.
        allowed: The ``(module, name)`` pairs that may be resolved.
        source: The file the pickle came from, named in every error.
    """

    def __init__(
        self, file: IO[bytes], *, allowed: Iterable[tuple[str, str]], source: str
    ) -> None:
        super().__init__(file)
        self._allowed = frozenset(allowed)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        """Resolve ``module.name`` if allowed; otherwise refuse without importing anything.

        Raises:
            UnsafeCheckpointError: The global is not on the allow-list.
        """
        if (module, name) not in self._allowed:
            raise UnsafeCheckpointError(
                f"{self._source}: refused to unpickle global {module}.{name} "
                "(not on the allow-list of checkpoint metadata types)",
                path=self._source,
                refused=f"{module}.{name}",
            )
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        """Refuse persistent ids: checkpoint metadata never contains any.

        Raises:
            UnsafeCheckpointError: Always.
        """
        raise UnsafeCheckpointError(
            f"{self._source}: refused a pickle persistent id ({type(pid).__name__}); "
            "checkpoint metadata never contains one",
            path=self._source,
            refused="persistent_load",
        )


def restricted_loads(
    data: bytes | IO[bytes],
    *,
    allowed: Iterable[tuple[str, str]],
    source: str,
    check: Callable[[Any], None] | None = None,
) -> Any:
    """Unpickle ``data`` resolving only the ``allowed`` globals.

    Args:
        data: The pickle, as bytes or a binary stream.
        allowed: The ``(module, name)`` pairs that may be resolved.
        source: The file the pickle came from, named in every error.
        check: Optional validation of the result; it raises to reject it.

    Returns:
        The unpickled object.

    Raises:
        UnsafeCheckpointError: The pickle references a global that is not allowed.
        UnreadableFormatError: A well-formed pickle whose objects do not build here (a
            field, class or constructor signature of another torch version).
        CorruptCheckpointError: The bytes are not a valid pickle of allowed objects.
    """
    stream: IO[bytes] = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        value = RestrictedUnpickler(stream, allowed=allowed, source=source).load()
    except UnsafeCheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError) as error:  # truncated, bad opcode
        raise CorruptCheckpointError(
            f"{source}: not a readable pickle ({type(error).__name__}: {error})",
            path=source,
            file=source,
        ) from error
    except Exception as error:  # an object's constructor or __setstate__ refused its state
        raise UnreadableFormatError(
            f"{source}: a pickle whose objects do not build here "
            f"({type(error).__name__}: {error})",
            path=source,
            file=source,
        ) from error
    if check is not None:
        check(value)
    return value


def _check_is_dcp_metadata(source: str) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        # Compared by name: this module must not import torch.distributed.checkpoint.
        kind = type(value)
        if (kind.__module__, kind.__qualname__) != (_DCP_METADATA_MODULE, "Metadata") or (
            not isinstance(getattr(value, "state_dict_metadata", None), dict)
        ):
            raise CorruptCheckpointError(
                f"{source}: holds a {type(value).__name__}, not DCP checkpoint metadata",
                path=source,
                file=source,
            )

    return check


def load_dcp_metadata(data: bytes | IO[bytes], *, source: str) -> Any:
    """Read a DCP ``.metadata`` pickle without allowing it to run code.

    Args:
        data: The file's bytes or a binary stream over them.
        source: The file's path or URL, named in every error.

    Returns:
        The ``torch.distributed.checkpoint.metadata.Metadata`` it holds.

    Raises:
        UnsafeCheckpointError: The pickle references a global outside
            :data:`DCP_METADATA_GLOBALS` (the error's ``refused`` names it).
        CorruptCheckpointError: The file is not a readable DCP metadata pickle.
    """
    return restricted_loads(
        data, allowed=DCP_METADATA_GLOBALS, source=source, check=_check_is_dcp_metadata(source)
    )
