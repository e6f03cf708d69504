"""torchtitan's own ``Trainer`` on CPU, for tests/dist/test_torchtitan_trainer.py.

``python -m torch.distributed.run --nproc-per-node 2 tests/dist/torchtitan_real_trainer_runner.py
--module tests.dist.torchtitan_trainer_config --config resumekit_debugmodel`` runs
``torchtitan.train.main``'s path - ``ConfigManager().parse_args()``, ``config.build()`` (the
``Trainer``), ``trainer.train()``, ``trainer.close()`` on an error or at the end (a
``SystemExit``, the preemption's exit 75, leaves as it does there) - after installing the
shims below, with three additions of the test's: a pause when the trainer fetches the
batch of the step after ``TITAN_PAUSE_AT`` (to be signalled or killed there; the data set
calls the hook before each sequence), each call of the
checkpointer's ``save`` is recorded before it is made (the steps trained), and when
``train()`` returns each rank writes its final state (``OUT/state_<rank>.pt``: whole
parameters, optimizer state, learning rates, scheduler, RNG, train state, the data loader's
state). Each rank writes
``OUT/rank_<rank>.json`` (the step it resumed from, the steps it trained, how it ended).

The shims (each installed before torchtitan is imported, each for the error it avoids):

1. ``torchtitan.distributed.minimal_async_ep.kernels`` (tests/torchtitan_models.py):
   ``ModuleNotFoundError: No module named 'triton'``; llama3 never calls its kernels.
2. ``torch.utils.tensorboard``: ``ModuleNotFoundError: No module named 'tensorboard'``
   (``torchtitan.components.metrics`` imports its ``SummaryWriter`` at module level; the
   config leaves ``metrics.enable_tensorboard`` off, so it is never built; the shim's
   ``SummaryWriter`` raises if it is).
3. ``datasets`` and ``datasets.distributed``: ``ModuleNotFoundError: No module named
   'datasets'`` (``torchtitan.trainer`` -> ``components.validate`` ->
   ``hf_datasets.text_datasets`` imports ``Dataset``, ``load_dataset``,
   ``split_dataset_by_node`` at module level; the config's data loader is its own and
   validation is off, so they are never called; the shim's raise if they are).
4. The device: with no accelerator ``torchtitan.tools.utils.get_device_info()`` answers
   ``("cuda", torch.cuda)``, and ``Trainer.__init__``'s ``device_module.set_device(...)``
   fails (``AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'``). Set to
   ``"cpu"`` and :func:`cpu_device_module` right after ``torchtitan.tools.utils`` is
   imported, before the modules that import its names (``distributed.utils``,
   ``parallel_dims``, ``metrics``).
   ``torch.cpu`` lacks the CUDA memory helpers torchtitan's ``DeviceMemoryMonitor`` calls
   (``AttributeError: module 'torch.cpu' has no attribute 'get_device_name'``, then
   ``get_device_properties``, ``reset_peak_memory_stats``, ``empty_cache``,
   ``memory_stats``): the shim answers them (no peak statistics: ``memory_stats`` is
   empty, which torchtitan reports as -1). And ``torch.cpu.current_device()`` is ``"cpu"``,
   which ``set_pg_timeouts``' ``barrier(device_ids=[current_device()])`` after the first
   step refuses (``TypeError: (): incompatible function arguments`` of ``BarrierOptions``):
   the shim's is 0, the index of ``torch.device("cpu", 0)``.
5. Flex attention: ``FlexAttention._compiled_flex_attn`` is ``torch.compile(flex_attention)``,
   which refuses CPU inputs that need a gradient, compiled or eager (``NotImplementedError:
   FlexAttention does not support backward on CPU``). :func:`flex_attention_on_cpu`
   computes what it would: the ``BlockMask``'s ``mask_mod`` (torchtitan's block-causal
   document mask) made dense with ``create_mask``, then ``scaled_dot_product_attention``
   with that mask (no ``score_mod``: llama3 has none; no log-sum-exp: llama3 asks for none).
6. FSDP2's gradient reduction: torchtitan's ``disable_fsdp_gradient_division`` sets every
   FSDP module's divide factor to 1.0 (it scales by the global token count itself), which
   FSDP2 reduce-scatters as ``ReduceOp.PREMUL_SUM(1.0)``, an op gloo lacks
   (``RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo``). The shim also sets
   ``set_force_sum_reduction_for_comms(True)`` (what torchtitan's own symmetric-memory path
   sets), so the reduction is ``ReduceOp.SUM`` with no division: the same sum.
7. ``torchtitan.distributed.utils.set_pg_timeouts`` (after the first step of each launch,
   to shorten the groups' timeouts to ``comm.train_timeout_seconds``) calls
   ``torch.distributed.set_timeout``, a nightly name that torch 2.13 lacks
   (``AttributeError: module 'torch.distributed' has no attribute 'set_timeout'``). The
   shim keeps its barrier and leaves the timeouts as the groups were made with
   (``comm.init_timeout_seconds``).
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any, NoReturn

import torch

from tests.distributed_harness import write_record

REPO_ROOT = Path(__file__).resolve().parents[2]

WORDS = 500
"""Words of the tokenizer's vocabulary (ids 1..WORDS; 0 is ``<unk>``), under the model's 2048."""


def write_tokenizer(folder: Path) -> None:
    """A word-level ``tokenizer.json`` (``w0`` .. ``w499``) for torchtitan's tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(WORDS)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))


def _refuse(what: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(f"{what} is a shim of resumekit's torchtitan trainer test")
    return refuse


def cpu_device_module() -> types.ModuleType:
    """``torch.cpu`` plus the CUDA memory helpers torchtitan's metrics call (shim 4)."""
    module = types.ModuleType("resumekit_tests_cpu_device")

    def delegate(name: str) -> Any:
        return getattr(torch.cpu, name)

    module.__getattr__ = delegate  # type: ignore[method-assign]
    module.get_device_name = lambda device=None: "cpu"  # type: ignore[attr-defined]
    module.get_device_properties = lambda device=None: types.SimpleNamespace(  # type: ignore[attr-defined]
        name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    module.memory_stats = lambda device=None: {}  # type: ignore[attr-defined]
    module.reset_peak_memory_stats = lambda device=None: None  # type: ignore[attr-defined]
    module.empty_cache = lambda: None  # type: ignore[attr-defined]
    module.current_device = lambda: 0  # type: ignore[attr-defined]
    return module


def flex_attention_on_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                          score_mod: Any, block_mask: Any, scale: float | None,
                          enable_gqa: bool, return_aux: Any, kernel_options: Any,
                          ) -> tuple[torch.Tensor, None]:
    """``flex_attention(q, k, v, block_mask=...)`` for llama3 on CPU (shim 5)."""
    from torch.nn.attention.flex_attention import create_mask
    from torch.nn.functional import scaled_dot_product_attention

    if score_mod is not None or return_aux.lse or return_aux.max_scores:
        raise RuntimeError("the CPU flex attention shim supports neither score_mod nor aux")
    batch, heads, length = query.shape[0], query.shape[1], query.shape[2]
    mask = create_mask(block_mask.mask_mod, batch, heads, length, key.shape[2],
                       device=query.device)
    out = scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                       enable_gqa=enable_gqa)
    return out, None


def install_shims() -> None:
    """The seven shims of this module's docstring, in order."""
    from tests.torchtitan_models import _shim_triton_kernels

    _shim_triton_kernels()  # 1

    tensorboard = types.ModuleType("torch.utils.tensorboard")  # 2
    tensorboard.SummaryWriter = _refuse("torch.utils.tensorboard.SummaryWriter")  # type: ignore[attr-defined]
    sys.modules["torch.utils.tensorboard"] = tensorboard

    datasets = types.ModuleType("datasets")  # 3
    datasets.Dataset = type("Dataset", (), {})  # type: ignore[attr-defined]
    datasets.load_dataset = _refuse("datasets.load_dataset")  # type: ignore[attr-defined]
    distributed = types.ModuleType("datasets.distributed")
    distributed.split_dataset_by_node = _refuse(  # type: ignore[attr-defined]
        "datasets.distributed.split_dataset_by_node")
    datasets.distributed = distributed  # type: ignore[attr-defined]
    sys.modules["datasets"] = datasets
    sys.modules["datasets.distributed"] = distributed

    import torchtitan.tools.utils as utils  # 4

    utils.device_type, utils.device_module = "cpu", cpu_device_module()

    from torchtitan.models.common.attention import FlexAttention  # 5

    FlexAttention._compiled_flex_attn = flex_attention_on_cpu

    import torchtitan.distributed.fsdp as fsdp  # 6

    disable_division = fsdp.disable_fsdp_gradient_division

    def disable_division_summing(model: torch.nn.Module) -> None:
        disable_division(model)
        for module in model.modules():
            if isinstance(module, fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = disable_division_summing

    import torchtitan.distributed.utils as dist_utils  # 7

    if not hasattr(torch.distributed, "set_timeout"):
        def set_pg_timeouts(timeout: Any, parallel_dims: Any) -> None:
            torch.distributed.barrier()

        dist_utils.set_pg_timeouts = set_pg_timeouts


def _whole(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        return full.detach().clone()
    return value


def _final_state(trainer: Any) -> dict[str, Any]:
    model = trainer.model_parts[0]
    names = {id(param): name for name, param in model.named_parameters()}
    optimizers = trainer.optimizers.optimizers
    return {
        "params": {name: _whole(param) for name, param in model.named_parameters()},
        "optimizer": {names[id(param)]: {key: _whole(value) for key, value in state.items()}
                      for part in optimizers for param, state in part.state.items()},
        "lr": [group["lr"] for part in optimizers for group in part.param_groups],
        "scheduler": trainer.lr_schedulers.state_dict(),
        "rng": torch.get_rng_state(),
        "train_state": trainer.state_dict(),
        "data": trainer.dataloader.dataset.state_dict(),
    }


def main() -> None:
    out = Path(os.environ["TITAN_OUT"])
    rank = int(os.environ["RANK"])
    record: dict[str, Any] = {"steps": [], "exit": 0}
    write_record(out, rank, record, lambda: _train(out, rank, record))


def _train(out: Path, rank: int, record: dict[str, Any]) -> None:
    """``torchtitan.train.main``'s body (less its structured logger), plus the test's hooks."""
    install_shims()
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    init_logger()
    config = ConfigManager().parse_args()
    trainer = None
    try:
        trainer = config.build()
        _hook(trainer, out, rank, record)
        trainer.train()
    except Exception:  # as main: close on an error; a SystemExit (75) leaves as it came
        if trainer:
            trainer.close()
        raise
    else:
        torch.save(_final_state(trainer), out / f"state_{rank}.pt")
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _hook(trainer: Any, out: Path, rank: int, record: dict[str, Any]) -> None:
    """Pause before the step after ``TITAN_PAUSE_AT``; record each ``save`` call."""
    from tests.dist.torchtitan_trainer_config import pause

    pause_at = int(os.environ.get("TITAN_PAUSE_AT", "0"))

    def before_window() -> None:  # the trainer fetches step N's batch after step += 1
        if pause_at and trainer.step == pause_at + 1 and not (out / f"paused_{rank}").exists():
            pause(out, rank, trainer.checkpointer.preemption)

    trainer.dataloader.dataset.before_window = before_window
    steps = record["steps"]
    save = trainer.checkpointer.save

    def recording_save(curr_step: int, last_step: bool = False) -> None:
        if not steps:
            record["restored"] = curr_step - 1
        steps.append(curr_step)  # trained (a preemption exits in save)
        save(curr_step, last_step=last_step)

    trainer.checkpointer.save = recording_save


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    main()
