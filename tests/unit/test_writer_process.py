"""async_writer="process": a background save's bytes written by a long-lived writer process."""

from __future__ import annotations

import dataclasses
import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from resumekit.background.process import WriterProcess
from resumekit.errors import (
    AsyncSaveError,
    ConfigurationError,
    StorageError,
    WriterProcessError,
)
from resumekit.manager import CheckpointManager
from resumekit.options import CheckpointOptions
from resumekit.tensors import state_dicts
from resumekit.tensors.remote import SharedTensor, WriteReply, WriteRequest
from resumekit.tensors.staging import CpuStager
from resumekit.warnings import ResumekitWarning
from tests.limits import HANG_S

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(autouse=True)
def _no_process_group() -> None:
    assert not dist.is_initialized(), "these tests are single-process"


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 5),
                          nn.BatchNorm1d(5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer)
    return model, optimizer


def _train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 48)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _manager(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
             **knobs: Any) -> CheckpointManager:
    knobs.setdefault("async_save", True)
    knobs.setdefault("async_writer", "process")
    return CheckpointManager(root, model=model, optimizer=optimizer, **knobs)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return state_dicts.model_and_optimizer_state(model, optimizer)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix: tree}


def _assert_bit_identical(left: dict[str, Any], right: dict[str, Any]) -> None:
    left, right = _flat(left), _flat(right)
    assert left.keys() == right.keys()
    for key, value in left.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == right[key].dtype, key
            assert torch.equal(value.view(-1).view(torch.uint8),
                               right[key].view(-1).view(torch.uint8)), key
        else:
            assert value == right[key], key


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, which has exited, does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("tensor_format", ["raw", "dcp"])
def test_a_checkpoint_the_writer_process_wrote_restores_bit_identical(
        tmp_path: Path, tensor_format: str) -> None:
    model, optimizer = _trained()
    ckpt = _manager(tmp_path, model, optimizer, tensor_format=tensor_format)
    ckpt.save(1)
    saved = {key: value for key, value in _state(model, optimizer).items()}
    saved = _flat({k: v for k, v in saved.items()})
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved.items()}
    _train(model, optimizer)  # the originals move on while the save writes
    ckpt.save(2)
    ckpt.wait()
    assert ckpt._writer is not None and ckpt._writer.pid is not None
    ckpt.close()

    fresh, fresh_optimizer = _trained(seed=1)
    reader = CheckpointManager(tmp_path, model=fresh, optimizer=fresh_optimizer)
    assert reader.restore(1) == 1
    _assert_bit_identical(saved, _flat(_state(fresh, fresh_optimizer)))
    assert reader.restore() == 2
    _assert_bit_identical(_state(model, optimizer), _state(fresh, fresh_optimizer))
    reader.close()


def test_the_writer_process_writes_the_same_raw_files_as_the_writer_threads(
        tmp_path: Path) -> None:
    # Raw format only: DCP's own format is not reproducible even in one process (its
    # .metadata differs from save to save), and its zip records' CRC fields depend on
    # which thread ran torch.save; the restore test above covers its bytes.
    tensor_format = "raw"
    model, optimizer = _trained()
    for writer in ("thread", "process"):
        with _manager(tmp_path / writer, model, optimizer, tensor_format=tensor_format,
                      async_writer=writer) as ckpt:
            ckpt.save(3)
    manifests = [CheckpointManager(tmp_path / writer, read_only=True).latest()
                 for writer in ("thread", "process")]
    assert manifests[0] is not None and manifests[1] is not None
    files = [{entry.path: (entry.size, entry.checksum)
              for entry in info.manifest.files if entry.path.startswith("tensors/")}
             for info in manifests]
    assert files[0] and files[0] == files[1]
    for name in files[0]:
        assert (Path(manifests[0].path) / name).read_bytes() \
            == (Path(manifests[1].path) / name).read_bytes(), name


def _tampered(ckpt: CheckpointManager, change: Any) -> None:
    """Make the writer process get ``change(request)`` instead of each request."""
    writer = ckpt._writer
    assert writer is not None
    original = writer.write

    def write(request: WriteRequest) -> WriteReply:
        return original(change(request))

    writer.write = write  # type: ignore[method-assign]


def test_an_error_in_the_writer_process_surfaces_at_the_next_step_end_with_its_traceback(
        tmp_path: Path) -> None:
    model, optimizer = _trained()
    ckpt = _manager(tmp_path, model, optimizer, save_every=2)
    ckpt.step_end(2)
    ckpt.wait()
    # The writer process is told to write into a directory that does not exist: its own
    # writer raises there (a StorageError naming the file), not in the trainer.
    missing = tmp_path / "no" / "such" / "dir"
    _tampered(ckpt, lambda request: dataclasses.replace(
        request, writer=dataclasses.replace(request.writer, path=str(missing))))
    ckpt.step_end(4)
    thread = ckpt._background._thread
    assert thread is not None
    thread.join()  # the save of step 4 has failed in the background by now
    with pytest.raises(AsyncSaveError) as caught:
        ckpt.step_end(5)
    error = caught.value
    assert error.step == 4
    cause = error.__cause__
    assert isinstance(cause, StorageError)
    assert str(missing) in str(error)
    assert cause.pid == ckpt._writer.pid  # type: ignore[union-attr]
    assert "the writer process's traceback" in str(error)
    assert "Traceback (most recent call last)" in cause.remote_traceback
    assert f"writer process (pid {cause.pid})" in "".join(cause.__notes__)
    assert [entry.step for entry in ckpt.checkpoints() if entry.status == "committed"] \
        == [2]
    ckpt.close()


def test_an_error_of_another_kind_in_the_writer_is_told_with_its_type_message_and_traceback(
        tmp_path: Path) -> None:
    model, optimizer = _trained()
    ckpt = _manager(tmp_path, model, optimizer)

    def lost_segment(request: WriteRequest) -> WriteRequest:
        data = [dataclasses.replace(value, segment=-1) if isinstance(value, SharedTensor)
                else value for value in request.data]
        return dataclasses.replace(request, data=data)

    _tampered(ckpt, lost_segment)
    ckpt.save(1)
    with pytest.raises(AsyncSaveError, match="background save of step 1 failed") as caught:
        ckpt.wait()
    cause = caught.value.__cause__
    assert isinstance(cause, WriterProcessError)
    assert cause.remote_type == "KeyError"
    assert "KeyError: -1" in cause.remote_traceback
    assert "KeyError: -1" in str(caught.value)  # the traceback is in the message
    ckpt.close()


def test_a_writer_process_killed_while_writing_is_reported_with_its_pid_and_signal(
        tmp_path: Path) -> None:
    model, optimizer = _trained()
    ckpt = _manager(tmp_path, model, optimizer)
    ckpt.save(1)
    ckpt.wait()
    step_1 = _flat(_state(model, optimizer))
    step_1 = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in step_1.items()}
    writer = ckpt._writer
    assert writer is not None
    original = writer._receive
    killed: list[int] = []

    def receive(process: subprocess.Popen[bytes], connection: Any) -> Any:
        killed.append(process.pid)  # the request is sent: the writer dies on it
        os.kill(process.pid, signal.SIGKILL)
        return original(process, connection)

    writer._receive = receive  # type: ignore[method-assign]
    _train(model, optimizer)
    ckpt.save(2)
    with pytest.raises(AsyncSaveError) as caught:
        ckpt.wait()
    cause = caught.value.__cause__
    assert isinstance(cause, WriterProcessError)
    assert (cause.pid, cause.exit_code, cause.signal) == (killed[0], -9, "SIGKILL")
    assert f"pid {killed[0]}" in str(caught.value) and "SIGKILL" in str(caught.value)
    assert caught.value.step == 2
    assert not _alive(killed[0])
    statuses = {entry.step: entry.status for entry in ckpt.checkpoints()}
    assert statuses == {1: "committed"}  # step 2's staging area is gone

    writer._receive = original  # type: ignore[method-assign]
    ckpt.save(3)  # a new writer process takes over
    ckpt.wait()
    assert writer.pid not in (None, killed[0])
    ckpt.close()

    fresh, fresh_optimizer = _trained(seed=1)
    reader = CheckpointManager(tmp_path, model=fresh, optimizer=fresh_optimizer)
    assert reader.restore(1) == 1
    _assert_bit_identical(step_1, _flat(_state(fresh, fresh_optimizer)))
    assert reader.restore() == 3
    reader.close()


def test_a_writer_process_killed_between_saves_is_warned_about_and_replaced(
        tmp_path: Path) -> None:
    model, optimizer = _trained()
    ckpt = _manager(tmp_path, model, optimizer, save_every=1)
    writer = ckpt._writer
    assert writer is not None and writer._process is not None  # started with stage_ahead
    pid = writer._process.pid
    os.kill(pid, signal.SIGKILL)
    writer._process.wait()  # dead before the save starts
    with pytest.warns(ResumekitWarning, match=rf"pid {pid}\) died between saves.*SIGKILL"):
        ckpt.step_end(1)
        ckpt.wait()
    assert writer.pid not in (None, pid)
    assert [entry.step for entry in ckpt.checkpoints() if entry.status == "committed"] == [1]
    ckpt.close()


def _pending_or_gone(pid: int, signals: tuple[signal.Signals, ...]) -> str:
    """Wait until ``pid`` has every one of ``signals`` pending, or has exited; say which."""
    wanted = sum(1 << (number - 1) for number in signals)
    exited = os.pidfd_open(pid)
    try:
        while True:
            try:
                with open(f"/proc/{pid}/status") as handle:
                    fields = dict(line.split(":", 1) for line in handle if ":" in line)
            except FileNotFoundError:
                return "gone"
            if fields["State"].split()[0] == "Z":
                return "gone"
            if int(fields["ShdPnd"], 16) & wanted == wanted:
                return "pending"
            # Woken by its exit, else looked at again (a signal's arrival has no fd).
            readable, _, _ = select.select([exited], [], [], 0.05)
            if readable:
                return "gone"
    finally:
        os.close(exited)


@pytest.mark.timeout(HANG_S)
def test_a_sigterm_to_the_process_group_while_the_writer_starts_up_does_not_kill_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun's agent killpg-s each worker's group at a SIGTERM (SLURM signals every
    # process of the step): the writer process, still importing torch, got it too and
    # died, taking the save in flight with it. Its interpreter is held before its first
    # instruction here (a launcher waiting on a FIFO), so the signals surely arrive first.
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    launcher = tmp_path / "python"
    launcher.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, sys
        with open({str(gate)!r}) as gate:
            gate.read()
        os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])
        """))
    launcher.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(launcher))
    model, optimizer = _trained()
    ckpt = _manager(tmp_path / "root", model, optimizer)  # stage_ahead: the writer starts
    monkeypatch.undo()
    writer = ckpt._writer
    assert writer is not None and writer.pid is not None
    pid = writer.pid
    for shielded in (signal.SIGTERM, signal.SIGINT):
        os.kill(pid, shielded)
    # Settled: the signals wait, blocked, in the starting writer - or they killed it.
    state = _pending_or_gone(pid, (signal.SIGTERM, signal.SIGINT))
    assert state == "pending", "the starting writer process died of the signals"
    with open(gate, "w") as release:  # the launcher reads it and execs the writer
        release.write("go")
    ckpt.save(1)
    ckpt.wait()  # written by that very process: the signals were discarded, not fatal
    assert writer.pid == pid and _alive(pid)
    assert [entry.step for entry in ckpt.checkpoints() if entry.status == "committed"] == [1]
    ckpt.close()


def test_close_leaves_no_writer_process_behind(tmp_path: Path) -> None:
    model, optimizer = _trained()
    ckpt = _manager(tmp_path, model, optimizer)
    ckpt.save(1)
    ckpt.wait()
    assert ckpt._writer is not None
    pid = ckpt._writer.pid
    assert pid is not None and _alive(pid)
    ckpt.close()
    with pytest.raises(ChildProcessError):  # reaped: no zombie left either
        os.waitpid(pid, os.WNOHANG)
    assert not _alive(pid)
    ckpt.close()  # idempotent


def test_the_writer_process_exits_when_the_trainer_dies(tmp_path: Path) -> None:
    trainer = textwrap.dedent(f"""
        import os, signal, sys, torch
        from torch import nn
        from resumekit.manager import CheckpointManager
        model = nn.Linear(8, 8)
        ckpt = CheckpointManager({str(tmp_path)!r}, model=model, async_save=True,
                                 async_writer="process")
        ckpt.save(1)
        ckpt.wait()
        print(ckpt._writer.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", trainer], capture_output=True, text=True,
                            env=env, timeout=HANG_S, check=False)
    assert result.returncode == -signal.SIGKILL, result.stderr
    pid = int(result.stdout.split()[0])
    # The writer sees its socket's EOF and exits: an orphan, reaped by init. Its pidfd
    # turns readable when it exits (a generous bound: it is not a timing assertion).
    try:
        exited = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone already
    try:
        readable, _, _ = select.select([exited], [], [], 120)
    finally:
        os.close(exited)
    assert readable, f"writer process {pid} outlived its trainer"


def test_a_shared_stager_carves_every_buffer_of_a_state_out_of_one_segment() -> None:
    model, optimizer = _trained()
    state = _state(model, optimizer)
    stager = CpuStager(shared=True)
    stager.prepare(state)
    segments = stager.segments()
    assert len(segments) == 1
    start = segments[0].data.data_ptr()
    for buffer in stager._buffers.values():
        if buffer.numel():
            assert buffer.untyped_storage().data_ptr() == start
            assert buffer.data_ptr() % 4096 == 0
    staged = stager.stage(state)
    assert stager.segments() == segments  # nothing new for the same state
    _assert_bit_identical(staged, {k: v for k, v in state.items()})
    stager.close()
    assert segments[0].fd == -1


def test_a_shared_stager_gives_a_changed_tensor_a_new_segment_and_closes_the_unused_one(
        ) -> None:
    stager = CpuStager(shared=True)
    stager.stage({"a": torch.ones(1000)})
    first = stager.segments()
    stager.stage({"a": torch.ones(2000)})
    assert len(stager.segments()) == 1 and stager.segments() != first
    assert first[0].fd == -1
    stager.close()


def test_the_process_writer_needs_async_save() -> None:
    with pytest.raises(ConfigurationError, match="needs async_save=True") as caught:
        CheckpointOptions(async_writer="process")
    assert caught.value.name == "async_writer"
    assert CheckpointOptions(async_writer="thread").async_writer == "thread"
    assert CheckpointOptions(async_save=True, async_writer="process").async_writer == "process"


def test_a_manager_without_async_save_starts_no_writer_process(tmp_path: Path) -> None:
    model, optimizer = _trained()
    with CheckpointManager(tmp_path, model=model, optimizer=optimizer) as ckpt:
        assert ckpt._writer is None
    with pytest.raises(ConfigurationError, match="async_writer"):
        CheckpointManager(tmp_path, model=model, async_writer="process")


def test_a_blocking_save_of_a_process_writer_manager_is_written_in_process(
        tmp_path: Path) -> None:
    model, optimizer = _trained()
    ckpt = _manager(tmp_path, model, optimizer, stage_ahead=False)
    ckpt.save(1, blocking=True)
    assert ckpt._writer is not None and ckpt._writer.pid is None  # never started
    ckpt.close()
    assert WriterProcess(lambda: []).pid is None


def _with_history(length: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 5))
    model.register_buffer("history", torch.randn(length))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer)
    return model, optimizer


def test_a_buffer_restaged_after_a_shape_change_reaches_the_writer_process_in_a_new_segment(
        tmp_path: Path) -> None:
    model, optimizer = _with_history(10, seed=0)
    ckpt = _manager(tmp_path, model, optimizer)
    ckpt.save(1)
    ckpt.wait()
    assert ckpt._stager is not None
    before = [segment.key for segment in ckpt._stager.segments()]
    model.history = torch.randn(20)  # type: ignore[assignment] - a new shape: a new buffer
    _train(model, optimizer)
    ckpt.save(2)  # its segment is sent to the writer process before the request
    ckpt.wait()
    keys = [segment.key for segment in ckpt._stager.segments()]
    assert keys[:len(before)] == before and len(keys) == len(before) + 1
    assert len(set(keys)) == len(keys)
    ckpt.close()
    fresh, fresh_optimizer = _with_history(20, seed=1)
    reader = CheckpointManager(tmp_path, model=fresh, optimizer=fresh_optimizer)
    assert reader.restore() == 2
    _assert_bit_identical(_state(model, optimizer), _state(fresh, fresh_optimizer))
    reader.close()
