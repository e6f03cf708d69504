"""Which read errors are transient, and reading again after them with bounded backoff.

A flaky network filesystem or object store fails a read now and then (``EIO``,
``ETIMEDOUT``, a dropped connection) although the bytes are fine. Such an error says
nothing about the checkpoint, so restore retries the read (:func:`read_with_retry`,
built on tenacity) instead of taking a good checkpoint for a corrupt one. What fails a
checksum or a size is never retried here: it is reported as corruption at once. When
every attempt failed, :class:`~resumekit.errors.StorageError` names the file and the
attempts, and the checkpoint is left where it is.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import TypeVar

import tenacity

from resumekit.errors import ResumekitError, StorageError

__all__ = [
    "CONFLICT_ATTEMPTS",
    "READ_ATTEMPTS",
    "TRANSIENT_ERRNOS",
    "create_with_retry",
    "is_conditional_conflict",
    "is_transient",
    "read_with_retry",
]

logger = logging.getLogger("resumekit")

T = TypeVar("T")

#: How many times one file is read before its error is reported (the first try included).
READ_ATTEMPTS = 5
#: How many times one exclusive create is sent while the store answers that another
#: request on the same key was in flight (S3's 409 ``ConditionalRequestConflict``).
CONFLICT_ATTEMPTS = 5
#: Wait between attempts: 0.1, 0.2, 0.4, 0.8 s (exponential, at most 2 s) plus up to 0.1 s
#: of jitter each, under 2 s in all over the five attempts. Tests may replace it with
#: ``tenacity.wait_none()``.
BACKOFF: tenacity.wait.wait_base = (tenacity.wait_exponential(multiplier=0.1, max=2.0)
                                    + tenacity.wait_random(0, 0.1))
#: ``errno`` values that say "try again", not "these bytes are bad".
TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name) for name in (
        "EIO", "ETIMEDOUT", "EAGAIN", "EINTR", "EBUSY", "ESTALE", "ECONNRESET",
        "ECONNABORTED", "ECONNREFUSED", "EPIPE", "ENETDOWN", "ENETUNREACH", "ENETRESET",
        "EHOSTDOWN", "EHOSTUNREACH", "ENOLINK", "ECOMM",
    ) if hasattr(errno, name)
)
#: Connection failures of HTTP clients under object-store filesystems (botocore, aiohttp)
#: that are not ``OSError``s, recognised by class name so neither is imported here.
_TRANSIENT_CLASS_NAMES = frozenset({
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
    "ConnectTimeoutError", "ResponseStreamingError", "IncompleteReadError",
    "ClientConnectionError", "ServerDisconnectedError", "ClientPayloadError",
})


def is_transient(error: BaseException) -> bool:
    """Return whether ``error`` (or what it wraps) is a read failure worth retrying.

    ``ConnectionError``, ``TimeoutError``, an ``OSError`` whose ``errno`` is in
    :data:`TRANSIENT_ERRNOS`, and the connection errors of HTTP clients count; a missing
    file (``FileNotFoundError``) and every checksum or size mismatch do not.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, FileNotFoundError) or (
            isinstance(current, ResumekitError) and not isinstance(current, StorageError)
        ) or getattr(current, "attempts", None):  # already retried: never again
            return False
        if isinstance(current, (ConnectionError, TimeoutError)):
            return True
        if isinstance(current, OSError) and current.errno in TRANSIENT_ERRNOS:
            return True
        if any(cls.__name__ in _TRANSIENT_CLASS_NAMES for cls in type(current).__mro__):
            return True
        current = current.__cause__ or current.__context__
    return False


def read_with_retry(what: str, read: Callable[[], T], *,
                    attempts: int | None = None) -> T:
    """Return ``read()``, reading again after transient errors with bounded backoff.

    Args:
        what: The file being read (named in the log and in the error).
        read: Reads it whole; called again from the start after a transient error, so
            it must not depend on what an earlier, failed call did.
        attempts: Calls at most (default :data:`READ_ATTEMPTS`).

    Returns:
        What ``read`` returned.

    Raises:
        StorageError: Every attempt failed with a transient error (attributes ``path``,
            ``operation="read"``, ``attempts``); the last error is its cause.
        Exception: Any other error of ``read``, unchanged, at once.
    """
    limit = READ_ATTEMPTS if attempts is None else max(1, attempts)

    def log_retry(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        logger.warning("resumekit: reading %s failed (%s: %s), attempt %d of %d; retrying",
                       what, type(error).__name__, error, state.attempt_number, limit)

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(limit), wait=BACKOFF,
        retry=tenacity.retry_if_exception(is_transient), before_sleep=log_retry,
        reraise=False)
    try:
        return retrying(read)
    except tenacity.RetryError as exhausted:
        last = exhausted.last_attempt.exception()
        raise StorageError(
            f"reading {what} failed {limit} times with transient errors (last: "
            f"{type(last).__name__}: {last}); a transient storage error, not corruption: "
            "nothing was set aside, the checkpoint was left as it is - check the storage "
            "and run again", path=what, operation="read", attempts=limit,
        ) from last


def is_conditional_conflict(error: BaseException) -> bool:
    """Whether ``error`` (or what it wraps) is an object store's conditional-write conflict.

    S3 answers a ``PUT`` with ``If-None-Match: *`` with 409 ``ConditionalRequestConflict``
    when another request on the same key is in flight: nothing was written and the
    request may be sent again; the retry then succeeds, or fails with 412 (the key exists).
    Recognised by the error code (or HTTP status) of the botocore error it wraps.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code == "ConditionalRequestConflict" or status == 409:
                return True
        current = current.__cause__ or current.__context__
    return False


def create_with_retry(what: str, create: Callable[[], None], *,
                      attempts: int | None = None) -> None:
    """Run ``create()`` (an exclusive create), again after a conditional-write conflict.

    Args:
        what: The file being created (named in the log and in the error).
        create: Sends the exclusive create; ``FileExistsError`` when the key exists.
        attempts: Calls at most (default :data:`CONFLICT_ATTEMPTS`).

    Raises:
        FileExistsError: Something is already there (from ``create``, unchanged).
        StorageError: The store answered with a conflict every time (attributes ``path``,
            ``operation="write"``, ``attempts``); nothing was written.
        Exception: Any other error of ``create``, unchanged, at once.
    """
    limit = CONFLICT_ATTEMPTS if attempts is None else max(1, attempts)

    def log_retry(state: tenacity.RetryCallState) -> None:
        logger.warning("resumekit: creating %s met a conflicting request on the same key "
                       "(409 ConditionalRequestConflict), attempt %d of %d; sending it again",
                       what, state.attempt_number, limit)

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(limit), wait=BACKOFF,
        retry=tenacity.retry_if_exception(is_conditional_conflict), before_sleep=log_retry,
        reraise=False)
    try:
        retrying(create)
    except tenacity.RetryError as exhausted:
        last = exhausted.last_attempt.exception()
        raise StorageError(
            f"creating {what} failed {limit} times: the store answered 409 "
            "ConditionalRequestConflict each time (another request on the same key was in "
            "flight); nothing was written - run again", path=what, operation="write",
            attempts=limit,
        ) from last
