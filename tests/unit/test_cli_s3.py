"""Every command on an S3 root (loopback moto server), options from --storage-option."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.storage_backends import S3Endpoint
from tests.unit.test_cli_support import assert_one_error_line, run_cli, run_json, write_checkpoints

pytestmark = pytest.mark.s3


def _flags(endpoint: S3Endpoint) -> list[str]:
    options = endpoint.storage_options
    return [
        "--storage-option", f"endpoint_url={options['endpoint_url']}",
        "--storage-option", f"key={options['key']}",
        "--storage-option", f"secret={options['secret']}",
        "--storage-option", "client_kwargs.region_name=us-east-1",
    ]


@pytest.fixture(scope="module")
def s3_run(s3_endpoint: S3Endpoint) -> tuple[str, dict[str, torch.Tensor], S3Endpoint]:
    url = f"s3://{s3_endpoint.bucket}/cli-{uuid.uuid4().hex[:8]}"
    trainer = write_checkpoints(url, [10, 20], storage_options=s3_endpoint.storage_options)
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return url, state, s3_endpoint


def test_inspect_lists_an_s3_root_and_describes_one_checkpoint(
    s3_run: tuple[str, dict[str, torch.Tensor], S3Endpoint], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _, endpoint = s3_run
    code, document, err = run_json(capsys, "inspect", url, *_flags(endpoint))
    assert code == 0, err
    assert [(e["step"], e["status"]) for e in document["checkpoints"]] == [
        (10, "committed"), (20, "committed")]
    assert document["resume_from"] == 20
    code, document, err = run_json(capsys, "inspect", f"{url}/step_000000020", "--tensors",
                                   *_flags(endpoint))
    assert code == 0, err
    assert document["manifest"]["data_dir"].startswith("attempt-")
    assert {t["name"] for t in document["tensors"]} >= {"model.0.weight", "model.2.bias"}
    assert document["state"]["ranks"][0]["data"]["consumed"] == 8


def test_verify_export_diff_and_prune_work_on_an_s3_root(
    s3_run: tuple[str, dict[str, torch.Tensor], S3Endpoint], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, state, endpoint = s3_run
    flags = _flags(endpoint)
    code, out, err = run_cli(capsys, "verify", url, "--all", *flags)
    assert code == 0, err
    assert out.count("ok ") == 2
    code, _, err = run_cli(capsys, "export", url, "--out", str(tmp_path), *flags)
    assert code == 0, err
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(weights[k], v) for k, v in state.items())
    code, document, _ = run_json(capsys, "diff", url, url, "--step-a", "10", *flags)
    assert code == 1 and "model.0.weight" in {d["key"] for d in document["differences"]}
    code, document, _ = run_json(capsys, "prune", url, "--keep-last", "1", "--dry-run", *flags)
    assert code == 0 and document["deleted"] == [10] and document["kept"] == [20]


def test_an_s3_root_without_its_endpoint_fails_in_one_line(
    s3_run: tuple[str, dict[str, torch.Tensor], S3Endpoint], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _, endpoint = s3_run
    code, _, err = run_cli(capsys, "inspect", f"{url}-missing", *_flags(endpoint))
    assert code == 1
    assert_one_error_line(err, "does not exist")
