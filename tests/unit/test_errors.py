"""The error hierarchy: one base class, a built-in per subclass, data that survives pickling."""

from __future__ import annotations

import inspect
import pickle

import pytest

import resumekit.errors as errors_module
from resumekit.errors import (
    AsyncSaveError,
    CheckpointLoadError,
    CheckpointNotFoundError,
    ConfigurationError,
    CorruptCheckpointError,
    DistributedSetupError,
    IncompatibleCheckpointError,
    IncompatibleVersionError,
    IncompleteCheckpointError,
    ManifestError,
    MissingDependencyError,
    ResumekitError,
    StepCollisionError,
    StorageError,
    UnreadableFormatError,
    UnsafeCheckpointError,
    UnsupportedSchemaError,
    WriterProcessError,
)

ALL_ERRORS = sorted(
    (
        value for value in vars(errors_module).values()
        if inspect.isclass(value) and issubclass(value, ResumekitError)
    ),
    key=lambda cls: cls.__name__,
)
SUBCLASSES = [cls for cls in ALL_ERRORS if cls is not ResumekitError]

#: The built-in each documented error must be catchable as.
EXPECTED_BUILTINS: dict[type[ResumekitError], tuple[type[BaseException], ...]] = {
    CheckpointNotFoundError: (FileNotFoundError, OSError),
    StepCollisionError: (FileExistsError, OSError),
    IncompleteCheckpointError: (FileNotFoundError, OSError),
    CorruptCheckpointError: (ValueError,),
    ManifestError: (CorruptCheckpointError, ValueError),
    UnsupportedSchemaError: (ManifestError, CorruptCheckpointError, ValueError),
    UnsafeCheckpointError: (ValueError,),
    StorageError: (OSError,),
    IncompatibleCheckpointError: (ValueError,),
    IncompatibleVersionError: (IncompatibleCheckpointError, ValueError),
    UnreadableFormatError: (CorruptCheckpointError, ValueError),
    AsyncSaveError: (RuntimeError,),
    CheckpointLoadError: (RuntimeError,),
    WriterProcessError: (RuntimeError,),
    DistributedSetupError: (RuntimeError,),
    ConfigurationError: (ValueError,),
    MissingDependencyError: (ConfigurationError, ValueError, ImportError),
}

FIELDS = {
    "path": "/ckpt/step_000001000/model.bin",
    "step": 1000,
    "file": "model/shard_0.bin",
    "newest": 1200,
    "differences": ["world_size: 8 != 4"],
    "schema_version": 99,
}


def _builtin_bases(cls: type[BaseException]) -> list[type[BaseException]]:
    return [base for base in cls.__mro__
            if base.__module__ == "builtins" and base not in (BaseException, Exception, object)]


def test_every_error_the_module_exports_is_a_resumekit_error() -> None:
    exported = {getattr(errors_module, name) for name in errors_module.__all__}
    assert exported == set(ALL_ERRORS)
    assert sorted(errors_module.__all__) == list(errors_module.__all__)


@pytest.mark.parametrize("cls", SUBCLASSES, ids=lambda cls: cls.__name__)
def test_every_error_is_also_a_builtin_a_caller_would_catch(cls: type[ResumekitError]) -> None:
    assert _builtin_bases(cls), f"{cls.__name__} derives from no specific built-in"
    error = cls("message naming /ckpt/step_000000001", path="/ckpt/step_000000001")
    assert isinstance(error, ResumekitError)
    for expected in EXPECTED_BUILTINS.get(cls, ()):
        assert isinstance(error, expected)


def test_the_documented_errors_all_have_an_expected_builtin() -> None:
    assert set(EXPECTED_BUILTINS) <= set(SUBCLASSES)


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda cls: cls.__name__)
def test_every_error_pickles_with_its_message_and_attributes(cls: type[ResumekitError]) -> None:
    message = f"{cls.__name__}: step 1000 at /ckpt/step_000001000/model.bin"
    error = cls(message, **FIELDS)
    restored = pickle.loads(pickle.dumps(error))
    assert type(restored) is cls
    assert str(restored) == message
    assert restored.message == message
    assert restored.args == (message,)
    assert restored.fields == FIELDS
    for name, value in FIELDS.items():
        assert getattr(restored, name) == value
    for builtin in _builtin_bases(cls):
        assert isinstance(restored, builtin)


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda cls: cls.__name__)
def test_every_error_pickles_after_being_raised_from_another(
    cls: type[ResumekitError],
) -> None:
    try:
        try:
            raise KeyError("inner")
        except KeyError as inner:
            raise cls("outer failure naming step 7", step=7) from inner
    except ResumekitError as raised:
        restored = pickle.loads(pickle.dumps(raised, protocol=pickle.HIGHEST_PROTOCOL))
    assert type(restored) is cls
    assert restored.step == 7
    assert str(restored) == "outer failure naming step 7"


def test_an_error_without_fields_pickles() -> None:
    restored = pickle.loads(pickle.dumps(ResumekitError("plain")))
    assert restored.fields == {}
    assert str(restored) == "plain"


def test_a_storage_error_keeps_its_errno_across_pickling() -> None:
    error = StorageError("cannot write /ckpt/x: No space left on device",
                         path="/ckpt/x", operation="write", errno=28)
    restored = pickle.loads(pickle.dumps(error))
    assert restored.errno == 28
    assert restored.operation == "write"
    assert restored.path == "/ckpt/x"


def test_catching_the_builtin_catches_the_resumekit_error() -> None:
    with pytest.raises(FileNotFoundError):
        raise CheckpointNotFoundError("no checkpoint under /ckpt", path="/ckpt")
    with pytest.raises(FileExistsError):
        raise StepCollisionError("step 5 exists", step=5, newest=5)
    with pytest.raises(ValueError):
        raise UnsupportedSchemaError("/ckpt/manifest.json: schema 9", path="/ckpt",
                                     schema_version=9)
