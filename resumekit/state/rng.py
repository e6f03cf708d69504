"""Capture and restore every random stream of one rank, and pick streams when resharding.

A resumed run replays an uninterrupted one only if every random draw after the resume
equals the draw the uninterrupted run made: dropout masks, data augmentation, noise
schedules. Each rank therefore saves, in its own per-rank file, the state of

* python's global ``random`` module,
* numpy's global generator (``np.random``; the legacy ``RandomState``/MT19937 one),
* torch's default CPU generator,
* the default generator of every visible CUDA device (when CUDA is available),
* any named ``torch.Generator`` the user registers (a data-augmentation generator, ...).

The state returned by :func:`capture_rng` is made only of tensors, ints, floats, strings,
``None``, lists and dicts, so ``torch.load(weights_only=True)`` reads it back. Its keys:

``version`` (int), ``origin`` (str: ``"captured"`` or how it was derived), ``python``
(dict: ``version``, ``internal`` int64 tensor, ``gauss_next``), ``numpy`` (dict:
``bit_generator``, ``key`` int64 tensor, ``pos``, ``has_gauss``, ``cached_gaussian``),
``torch`` (uint8 tensor), ``cuda`` (``None`` when captured without CUDA, else one entry
per device), ``generators`` (name -> dict with ``device`` and either ``state`` or ``seed``).
A ``cuda`` entry is a state tensor, or an int seed in states made by :func:`select_rank_rng`.

Restore policy (what :func:`restore_rng` does when the state does not fit the process):

* A registered generator whose name the state lacks, or whose saved device type differs:
  :class:`~resumekit.errors.IncompatibleCheckpointError` naming ``generators.<name>``,
  raised before anything is restored. The caller asked for that exact stream; silently
  leaving it unrestored would break the replay without telling anyone.
* A generator in the state that nobody registered: a
  :class:`~resumekit.warnings.ResumekitWarning` naming it; it is ignored.
* CUDA states for a different number of devices than are visible now, CUDA states with
  CUDA unavailable, or no CUDA states with CUDA available: a ``ResumekitWarning`` naming
  the ``cuda`` key; the devices both sides have (the lower indices) are restored, the
  rest keep their current state. This is a warning, not an error, because a job that is
  requeued onto a differently shaped node must still resume; it only stops being a
  bit-exact replay, and the warning says so.

Resharding policy (:func:`select_rank_rng`): when a checkpoint written by N ranks is read
by M ranks, a rank r that has a saved state (r < N) gets exactly its own streams. A rank
r >= N gets streams derived deterministically from rank 0's saved state and r: every
source is reseeded from a BLAKE2b hash of rank 0's whole state, r and the source's name.
The same checkpoint and rank always give the same streams, different ranks give different
streams, and a ``ResumekitWarning`` says that this rank's draws are new.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from resumekit.errors import IncompatibleCheckpointError
from resumekit.warnings import ResumekitWarning, warn

__all__ = ["RNG_STATE_VERSION", "capture_rng", "restore_rng", "select_rank_rng"]

RNG_STATE_VERSION = 1
"""Version of the dictionary layout :func:`capture_rng` returns."""

_SOURCES = ("python", "numpy", "torch", "cuda", "generators")


def _cuda_generators() -> Sequence[torch.Generator]:
    """The default generator of every visible CUDA device; empty without CUDA."""
    if not torch.cuda.is_available():
        return ()
    torch.cuda.init()
    return tuple(torch.cuda.default_generators)


# ----------------------------------------------------------------------------- capture


def _python_state(state: tuple[Any, ...]) -> dict[str, Any]:
    version, internal, gauss_next = state
    return {
        "version": int(version),
        "internal": torch.tensor(internal, dtype=torch.int64),
        "gauss_next": gauss_next,
    }


def _numpy_state(state: tuple[Any, ...] | dict[str, Any]) -> dict[str, Any]:
    if isinstance(state, dict):  # only when np.random's global bit generator was replaced
        raise _fail("numpy", f"global bit generator {state.get('bit_generator')} is not MT19937")
    name, key, pos, has_gauss, cached_gaussian = state
    return {
        "bit_generator": str(name),
        "key": torch.from_numpy(np.asarray(key, dtype=np.int64).copy()),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def capture_rng(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
    """Capture every random stream of this process.

    Args:
        generators: Named ``torch.Generator`` objects the training code draws from besides
            the global ones (``{"augment": aug_gen}``); captured under their names.

    Returns:
        A dictionary of tensors and plain values (layout in the module docstring) that
        ``torch.save`` writes and ``torch.load(weights_only=True)`` reads back.
    """
    cuda = _cuda_generators()
    return {
        "version": RNG_STATE_VERSION,
        "origin": "captured",
        "python": _python_state(random.getstate()),
        "numpy": _numpy_state(np.random.get_state(legacy=True)),
        "torch": torch.get_rng_state(),
        "cuda": [gen.get_state() for gen in cuda] if cuda else None,
        "generators": {
            name: {"device": str(gen.device), "state": gen.get_state()}
            for name, gen in sorted((generators or {}).items())
        },
    }


# ----------------------------------------------------------------------------- restore


def _fail(key: str, problem: str) -> IncompatibleCheckpointError:
    return IncompatibleCheckpointError(
        f"RNG state key '{key}': {problem}", key=key, differences=[f"{key}: {problem}"]
    )


def _get(state: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in state:
        raise _fail(f"{where}{key}", "missing")
    value = state[key]
    if not isinstance(value, kind):
        raise _fail(f"{where}{key}", f"expected {kind}, found {type(value).__name__}")
    return value


def _check(state: Any) -> None:
    """Validate the layout, so that a bad state fails before anything is restored."""
    if not isinstance(state, Mapping):
        raise _fail("<root>", f"expected a dict, found {type(state).__name__}")
    version = _get(state, "version", int, "")
    if version != RNG_STATE_VERSION:
        raise _fail("version", f"layout {version} is not {RNG_STATE_VERSION} (newer resumekit?)")
    python = _get(state, "python", Mapping, "")
    _get(python, "version", int, "python.")
    _get(python, "internal", torch.Tensor, "python.")
    numpy_state = _get(state, "numpy", Mapping, "")
    _get(numpy_state, "bit_generator", str, "numpy.")
    _get(numpy_state, "key", torch.Tensor, "numpy.")
    for key in ("pos", "has_gauss"):
        _get(numpy_state, key, int, "numpy.")
    _get(numpy_state, "cached_gaussian", (int, float), "numpy.")
    _get(state, "torch", torch.Tensor, "")
    if "cuda" not in state:
        raise _fail("cuda", "missing")
    cuda = state["cuda"]
    if cuda is not None:
        if not isinstance(cuda, (list, tuple)):
            raise _fail("cuda", f"expected a list or None, found {type(cuda).__name__}")
        for index, entry in enumerate(cuda):
            if not isinstance(entry, (torch.Tensor, int)):
                raise _fail(f"cuda.{index}", f"expected a tensor or int seed, found {entry!r}")
    named = _get(state, "generators", Mapping, "")
    for name, entry in named.items():
        where = f"generators.{name}."
        if not isinstance(entry, Mapping):
            raise _fail(f"generators.{name}", f"expected a dict, found {type(entry).__name__}")
        _get(entry, "device", str, where)
        if "state" in entry:
            _get(entry, "state", torch.Tensor, where)
        else:
            _get(entry, "seed", int, where)


def _warn(message: str, stacklevel: int = 3) -> None:
    """Warn, attributing the warning to the caller of the public function."""
    warn(message, ResumekitWarning, stacklevel=stacklevel)


def _restore_cuda(saved: Sequence[torch.Tensor | int] | None) -> None:
    present = _cuda_generators()
    if saved is None:
        if present:
            _warn(
                f"RNG state key 'cuda': the checkpoint was captured without CUDA; the "
                f"{len(present)} CUDA generator(s) here keep their current state",
                stacklevel=4,
            )
        return
    if not present:
        _warn(
            f"RNG state key 'cuda': the checkpoint holds {len(saved)} CUDA generator "
            f"state(s) but CUDA is not available here; they are not restored",
            stacklevel=4,
        )
        return
    if len(saved) != len(present):
        _warn(
            f"RNG state key 'cuda': the checkpoint holds {len(saved)} CUDA generator "
            f"state(s) but {len(present)} device(s) are visible; devices "
            f"0..{min(len(saved), len(present)) - 1} are restored, the rest are left as they are",
            stacklevel=4,
        )
    for gen, entry in zip(present, saved, strict=False):
        _apply(gen, entry)


def _apply(gen: torch.Generator, entry: torch.Tensor | int) -> None:
    if isinstance(entry, torch.Tensor):
        gen.set_state(entry.detach().to(device="cpu", dtype=torch.uint8))
    else:
        gen.manual_seed(entry)


def restore_rng(
    state: Mapping[str, Any], generators: Mapping[str, torch.Generator] | None = None
) -> None:
    """Put every random stream of this process back to a captured (or derived) state.

    After ``restore_rng(capture_rng())``-style round trips, every source draws exactly
    what it drew right after the capture. Policy for states that do not fit this process
    (missing generators, other CUDA device counts) is in the module docstring.

    Args:
        state: What :func:`capture_rng` or :func:`select_rank_rng` returned, possibly
            after a ``torch.save`` / ``torch.load(weights_only=True)`` round trip.
        generators: The named generators to restore, by the names they were captured under.

    Raises:
        IncompatibleCheckpointError: ``state`` is malformed, or lacks a generator named in
            ``generators`` (the error's ``key`` is ``generators.<name>``), holds it for
            another device type, or holds a state a generator rejects (wrong size). The
            python, numpy and torch CPU streams are left as they were when this is raised.
    """
    _check(state)
    named = state["generators"]
    wanted = dict(generators or {})
    for name, gen in wanted.items():
        if name not in named:
            raise _fail(
                f"generators.{name}",
                f"not in the checkpoint (it holds {sorted(named) or 'no named generators'})",
            )
        saved_type = torch.device(named[name]["device"]).type
        if saved_type != gen.device.type:
            raise _fail(
                f"generators.{name}",
                f"saved from a {saved_type} generator, restoring into a {gen.device.type} one",
            )
    unclaimed = sorted(set(named) - set(wanted))
    if unclaimed:
        _warn(
            f"RNG state keys {[f'generators.{name}' for name in unclaimed]}: saved but no "
            f"generator was registered under these names; they are not restored"
        )

    previous = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    key = "python"
    try:
        python = state["python"]
        internal = tuple(int(word) for word in python["internal"].tolist())
        random.setstate((python["version"], internal, python.get("gauss_next")))
        key = "numpy"
        numpy_state = state["numpy"]
        np.random.set_state(
            (
                numpy_state["bit_generator"],
                numpy_state["key"].numpy().astype(np.uint32),
                numpy_state["pos"],
                numpy_state["has_gauss"],
                float(numpy_state["cached_gaussian"]),
            )
        )
        key = "torch"
        torch.set_rng_state(state["torch"].detach().to(device="cpu", dtype=torch.uint8))
        key = "cuda"
        _restore_cuda(state["cuda"])
        for name, gen in wanted.items():
            key = f"generators.{name}"
            entry = named[name]
            _apply(gen, entry["state"] if "state" in entry else entry["seed"])
    except (ValueError, TypeError, RuntimeError, OverflowError) as error:
        random.setstate(previous[0])
        np.random.set_state(previous[1])
        torch.set_rng_state(previous[2])
        raise _fail(key, f"cannot be restored: {error}") from error


# ----------------------------------------------------------------------------- resharding


def _feed(digest: Any, value: Any) -> None:
    """Hash ``value`` canonically: same content, same bytes, whatever the dict order."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"T{value.dtype}{tuple(value.shape)}:".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        digest.update(b"{")
        for key in sorted(value, key=str):
            _feed(digest, key)
            _feed(digest, value[key])
        digest.update(b"}")
    elif isinstance(value, (list, tuple)):
        digest.update(b"[")
        for item in value:
            _feed(digest, item)
        digest.update(b"]")
    elif value is None or isinstance(value, (bool, int, float, str)):
        digest.update(f"{type(value).__name__}:{value!r};".encode())
    else:
        raise _fail("<value>", f"cannot hash a {type(value).__name__} in an RNG state")


class _Seeds:
    """Independent seeds, one per named source, from (rank 0's state, rank)."""

    def __init__(self, base_state: Mapping[str, Any], rank: int) -> None:
        digest = hashlib.blake2b(digest_size=32, person=b"resumekit-rng")
        _feed(digest, base_state)
        digest.update(f"rank={rank}".encode())
        self._root = digest.digest()

    def raw(self, source: str) -> bytes:
        return hashlib.blake2b(source.encode(), key=self._root, digest_size=32).digest()

    def u64(self, source: str) -> int:
        return int.from_bytes(self.raw(source)[:8], "little")


def _derive(base: Mapping[str, Any], rank: int, source_rank: int) -> dict[str, Any]:
    seeds = _Seeds(base, rank)
    cpu = torch.Generator().manual_seed(seeds.u64("torch"))
    python = random.Random(int.from_bytes(seeds.raw("python"), "little"))
    numpy_words = np.frombuffer(seeds.raw("numpy"), dtype=np.uint32)
    cuda = base["cuda"]
    generators: dict[str, Any] = {}
    for name, entry in base["generators"].items():
        seed = seeds.u64(f"generators.{name}")
        if torch.device(entry["device"]).type == "cpu":
            state = torch.Generator().manual_seed(seed).get_state()
            generators[name] = {"device": entry["device"], "state": state}
        else:
            generators[name] = {"device": entry["device"], "seed": seed}
    return {
        "version": RNG_STATE_VERSION,
        "origin": f"derived for rank {rank} from rank {source_rank}'s saved state",
        "python": _python_state(python.getstate()),
        "numpy": _numpy_state(np.random.RandomState(numpy_words).get_state(legacy=True)),
        "torch": cpu.get_state(),
        "cuda": None if cuda is None else [seeds.u64(f"cuda.{i}") for i in range(len(cuda))],
        "generators": generators,
    }


def select_rank_rng(saved_per_rank: Mapping[int, Mapping[str, Any]], rank: int) -> dict[str, Any]:
    """Choose the RNG state a rank restores when the world size may have changed.

    Args:
        saved_per_rank: The saved states by the rank that wrote them. Pass at least rank
            0's and, if it exists, ``rank``'s own; a rank absent from the mapping is
            treated as one the saved run did not have.
        rank: The restoring rank.

    Returns:
        ``rank``'s own saved state when present; otherwise a state derived from rank 0's
        saved state and ``rank`` (deterministic: same inputs, same streams), announced by
        a :class:`~resumekit.warnings.ResumekitWarning`.

    Raises:
        IncompatibleCheckpointError: ``rank`` is negative, or it must be derived and rank 0's
            state is missing or malformed.
    """
    if rank < 0:
        raise _fail("rank", f"rank {rank} is negative")
    if rank in saved_per_rank:
        return dict(saved_per_rank[rank])
    if 0 not in saved_per_rank:
        raise _fail(
            "0",
            f"rank {rank} has no saved RNG state and rank 0's, to derive one from, is missing "
            f"(saved ranks: {sorted(saved_per_rank)})",
        )
    base = saved_per_rank[0]
    _check(base)
    _warn(
        f"RNG state for rank {rank} is not in the checkpoint (saved ranks: "
        f"{sorted(saved_per_rank)}): this rank draws new streams derived from rank 0's "
        f"saved state and its rank number, so its draws match no rank of the saved run"
    )
    return _derive(base, rank, 0)
