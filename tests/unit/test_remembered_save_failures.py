"""A rank's failure in a remembered save travels to rank 0 pickled, whatever the Python."""

from __future__ import annotations

import pickle
import threading
import traceback

import pytest

from resumekit.tensors import remembered_save


class FrameWithCode(traceback.FrameSummary):
    """A frame holding its code object, as Python 3.13's frames do."""

    __slots__ = ("_code",)
    _code: object


def test_a_failure_with_frames_holding_code_objects_still_pickles_for_the_gather(
        monkeypatch: pytest.MonkeyPatch) -> None:
    original = traceback.extract_tb

    def with_code(tb: object) -> traceback.StackSummary:
        frames = []
        for plain in original(tb):  # type: ignore[arg-type]
            frame = FrameWithCode(plain.filename, plain.lineno, plain.name, line=plain.line)
            frame._code = (lambda: None).__code__  # a code object: it does not pickle
            frames.append(frame)
        return traceback.StackSummary(frames)

    monkeypatch.setattr(traceback, "extract_tb", with_code)
    try:
        raise OSError(28, "No space left on device")
    except OSError as error:
        wrapped = remembered_save._wrapped(error)
    error_back, summary = pickle.loads(pickle.dumps(wrapped))
    assert isinstance(error_back, OSError) and error_back.errno == 28
    assert remembered_save._is_failure((error_back, summary))
    assert summary[-1].name.startswith("test_a_failure_with_frames_holding_code")


class _HoldsALock(Exception):
    """A write error holding a lock: it does not pickle."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def test_a_failure_that_does_not_pickle_is_sent_to_rank_0_as_text_naming_it() -> None:
    try:
        raise _HoldsALock("the writer's pool broke")
    except _HoldsALock as error:
        wrapped = remembered_save._wrapped(error)
    error_back, summary = pickle.loads(pickle.dumps(wrapped))  # the gather's pickle
    assert remembered_save._is_failure((error_back, summary))
    assert "_HoldsALock: the writer's pool broke" in str(error_back)
    assert "does not pickle" in str(error_back)
    assert summary[-1].name.startswith("test_a_failure_that_does_not_pickle")
