"""The LingBot-VA example's samples: synthetic generation, episode files, collation."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from examples.lingbot.config import get_config
from examples.lingbot.data import (
    EPISODE_KEYS,
    EpisodeDirectoryDataset,
    SampleSpec,
    SyntheticEpisodeDataset,
    collate,
    save_episode,
)
from examples.lingbot.errors import (
    BatchError,
    EpisodeDirectoryError,
    EpisodeFileError,
)

CONFIG = get_config("tiny")
SPEC = SampleSpec.from_config(CONFIG)


def _dataset(seed: int = 0, num_samples: int = 64) -> SyntheticEpisodeDataset:
    return SyntheticEpisodeDataset(SPEC, num_samples, seed=seed, empty_prompt_prob=0.1)


def _assert_samples_equal(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert sorted(left) == sorted(right)
    for key, value in left.items():
        assert value.dtype == right[key].dtype, key
        assert torch.equal(value, right[key]), key


def test_a_synthetic_sample_has_the_documented_keys_shapes_and_dtypes() -> None:
    sample = SyntheticEpisodeDataset.from_config(CONFIG)[3]
    assert sorted(sample) == sorted([*EPISODE_KEYS, "index"])
    for key, shape in SPEC.shapes().items():
        assert tuple(sample[key].shape) == shape, key
    assert sample["latents"].shape[0] == 48
    assert sample["actions"].shape[1] == 30
    assert sample["latents"].dtype == sample["text"].dtype == sample["actions"].dtype == (
        torch.float32)
    assert sample["text_dropped"].dtype == sample["action_mask"].dtype == torch.bool
    assert int(sample["index"]) == 3


def test_a_synthetic_sample_is_reproduced_from_its_seed_and_index_alone() -> None:
    forward = _dataset()
    in_order = [forward[i] for i in range(10)]
    fresh = _dataset()
    # Index 7 straight away, without generating 0..6 first, then the others backwards.
    _assert_samples_equal(fresh[7], in_order[7])
    for index in reversed(range(10)):
        _assert_samples_equal(fresh[index], in_order[index])
    assert not torch.equal(in_order[7]["latents"], in_order[8]["latents"])
    assert not torch.equal(_dataset(seed=1)[7]["latents"], in_order[7]["latents"])


def test_an_index_outside_the_dataset_raises_index_error() -> None:
    dataset = _dataset(num_samples=5)
    with pytest.raises(IndexError, match="5"):
        dataset[5]
    with pytest.raises(IndexError):
        dataset[-1]


def test_about_ten_percent_of_prompts_are_dropped_to_zeros_with_the_flag_set() -> None:
    dataset = _dataset(num_samples=2000)
    dropped = 0
    for index in range(len(dataset)):
        sample = dataset[index]
        if bool(sample["text_dropped"]):
            dropped += 1
            assert not sample["text"].any(), index
        else:
            assert sample["text"].abs().sum() > 0, index
    # Binomial(2000, 0.1): standard deviation 13.4 samples; the band is about 3 sigma.
    assert 160 <= dropped <= 240, dropped


def test_actions_lie_in_minus_one_to_one_and_padded_steps_are_masked_and_zero() -> None:
    dataset = _dataset(num_samples=200)
    padded_samples = 0
    for index in range(len(dataset)):
        sample = dataset[index]
        actions, mask = sample["actions"], sample["action_mask"]
        assert actions.min() >= -1.0 and actions.max() <= 1.0
        valid = int(mask.sum())
        assert valid >= SPEC.action_frames // 2
        assert mask[:valid].all() and not mask[valid:].any(), "the mask is a prefix"
        assert not actions[valid:].any()
        padded_samples += valid < SPEC.action_frames
    assert 0 < padded_samples < len(dataset)


def _write_episodes(directory: Path, count: int) -> list[dict[str, torch.Tensor]]:
    source = _dataset()
    samples = []
    for index in range(count):
        suffix = ".pt" if index % 2 == 0 else ".safetensors"
        sample = source[index]
        save_episode(directory / f"episode_{index:03d}{suffix}", sample)
        samples.append(sample)
    return samples


def test_an_episode_directory_round_trips_pt_and_safetensors_files(tmp_path: Path) -> None:
    written = _write_episodes(tmp_path, 4)
    (tmp_path / "README.txt").write_text("not an episode")
    dataset = EpisodeDirectoryDataset(tmp_path, spec=SPEC)
    assert len(dataset) == 4
    for index, original in enumerate(written):
        _assert_samples_equal(dataset[index], original)
    batch = collate([dataset[0], dataset[1], dataset[3]])
    assert batch["latents"].shape == (3, *SPEC.shapes()["latents"])
    assert batch["index"].tolist() == [0, 1, 3]


def test_a_corrupt_episode_file_is_reported_by_name(tmp_path: Path) -> None:
    _write_episodes(tmp_path, 2)
    (tmp_path / "episode_001.safetensors").write_bytes(b"\x00garbage")
    (tmp_path / "episode_002.pt").write_bytes(b"not a pickle at all")
    dataset = EpisodeDirectoryDataset(tmp_path)
    dataset[0]
    for index, name in ((1, "episode_001.safetensors"), (2, "episode_002.pt")):
        with pytest.raises(EpisodeFileError, match=name) as caught:
            dataset[index]
        assert caught.value.path == str(tmp_path / name)  # type: ignore[attr-defined]


def test_an_episode_file_missing_a_key_is_reported_with_file_and_key(tmp_path: Path) -> None:
    sample = _dataset()[0]
    torch.save({key: value for key, value in sample.items() if key != "action_mask"},
               tmp_path / "episode.pt")
    with pytest.raises(EpisodeFileError, match=r"episode\.pt.*'action_mask' is missing") as caught:
        EpisodeDirectoryDataset(tmp_path)[0]
    assert caught.value.key == "action_mask"  # type: ignore[attr-defined]


def test_an_episode_file_of_the_wrong_shape_or_range_is_rejected(tmp_path: Path) -> None:
    sample = _dataset()[0]
    save_episode(tmp_path / "a_short.pt", {**sample, "latents": sample["latents"][:, :1]})
    save_episode(tmp_path / "b_range.pt", {**sample, "actions": sample["actions"] * 3 + 0.5})
    save_episode(tmp_path / "c_mask.pt", {**sample, "action_mask": sample["action_mask"][:2]})
    nan_text = torch.full_like(sample["text"], float("nan"))
    save_episode(tmp_path / "d_nan.pt", {**sample, "text": nan_text})
    dataset = EpisodeDirectoryDataset(tmp_path, spec=SPEC)
    expectations = [("a_short.pt", "'latents' has shape"), ("b_range.pt", "outside"),
                    ("c_mask.pt", "'action_mask' has 2 steps"), ("d_nan.pt", "NaN")]
    for index, (name, problem) in enumerate(expectations):
        with pytest.raises(EpisodeFileError, match=rf"{name}.*{problem}"):
            dataset[index]
    # Without a spec only self-consistency is checked: the short clip is accepted.
    assert EpisodeDirectoryDataset(tmp_path)[0]["latents"].shape[1] == 1


def test_a_missing_or_empty_episode_directory_is_reported(tmp_path: Path) -> None:
    with pytest.raises(EpisodeDirectoryError, match="does not exist") as caught:
        EpisodeDirectoryDataset(tmp_path / "absent")
    assert isinstance(caught.value, FileNotFoundError)
    (tmp_path / "notes.txt").write_text("nothing here")
    with pytest.raises(EpisodeDirectoryError, match=r"holds no \.pt or \.safetensors"):
        EpisodeDirectoryDataset(tmp_path)


def test_episode_errors_pickle_with_their_fields() -> None:
    error = EpisodeFileError("episode file x.pt: key 'text' is missing", path="x.pt", key="text")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is EpisodeFileError and isinstance(copy, ValueError)
    assert (str(copy), copy.path, copy.key) == (str(error), "x.pt", "text")


def test_collate_stacks_every_key_and_rejects_mismatched_samples() -> None:
    dataset = _dataset()
    batch = collate([dataset[0], dataset[1]])
    assert batch["latents"].shape == (2, *SPEC.shapes()["latents"])
    assert batch["text_dropped"].shape == (2,) and batch["index"].tolist() == [0, 1]
    short = {**dataset[1], "actions": dataset[1]["actions"][:2]}
    with pytest.raises(BatchError, match="'actions'"):
        collate([dataset[0], short])
    with pytest.raises(BatchError, match="keys"):
        collate([dataset[0], {k: v for k, v in dataset[1].items() if k != "index"}])
    with pytest.raises(BatchError, match="empty"):
        collate([])
