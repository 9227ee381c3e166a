"""Batching: padding and the shift by one that lines token t up with the logits at position t − 1."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from storage.records import TrainingSample
from trainer.algos.logprobs import token_logprobs
from trainer.batching import PAD_VERSION, collate


def _sample(
    tid: int,
    tokens: list[int],
    prompt_len: int,
    *,
    version: int = 3,
    reward: float = 1.0,
    group: str | None = "g",
    temperature: float = 1.0,
) -> TrainingSample:
    n = len(tokens)
    mask = np.arange(n) >= prompt_len
    logprobs = np.where(mask, -0.1 * (np.arange(n) + 1), 7.0).astype(np.float32)  # junk outside the mask
    versions = np.where(mask, version + np.arange(n) % 2, -1).astype(np.int32)
    return TrainingSample(
        trajectory_id=tid,
        token_ids=np.array(tokens, dtype=np.int32),
        loss_mask=mask,
        logprobs=logprobs,
        versions=versions,
        reward=reward,
        group_id=group,
        temperature=temperature,
    )


def test_collate_pads_right_and_shifts_every_field_by_one() -> None:
    long = _sample(10, [5, 6, 7, 8, 9], prompt_len=2, reward=1.0, temperature=0.7)
    short = _sample(11, [1, 2, 3], prompt_len=1, reward=-1.0, version=4)
    batch = collate([long, short], pad_id=0)

    assert batch.trajectory_ids == (10, 11)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 0, 0]]
    assert batch.targets.tolist() == [[6, 7, 8, 9], [2, 3, 0, 0]]
    # Column j describes token j + 1: the long sample's tokens 2..4 were generated, token 1 was prompt.
    assert batch.loss_mask.tolist() == [[False, True, True, True], [True, True, False, False]]
    expected = torch.tensor([[0.0, -0.3, -0.4, -0.5], [-0.2, -0.3, 0.0, 0.0]])
    assert torch.allclose(batch.behave_logprobs, expected)
    assert batch.versions.tolist() == [[-1, 3, 4, 3], [5, 4, PAD_VERSION, PAD_VERSION]]
    assert batch.rewards.tolist() == [1.0, -1.0]
    assert batch.temperatures.tolist() == pytest.approx([0.7, 1.0])
    assert batch.num_tokens == 5
    assert batch.input_ids.dtype == torch.long and batch.loss_mask.dtype == torch.bool


def test_samples_without_a_group_each_get_their_own() -> None:
    batch = collate(
        [
            _sample(1, [1, 2], 1, group=None),
            _sample(2, [1, 2], 1, group=None),
            _sample(3, [1, 2], 1, group="g"),
            _sample(4, [1, 2], 1, group="g"),
        ]
    )
    assert len(set(batch.group_ids)) == 3
    assert batch.group_ids[2] == batch.group_ids[3] == "g"


def test_select_takes_rows_and_trims_padding_to_them() -> None:
    batch = collate([_sample(1, [1, 2, 3, 4, 5, 6], 2), _sample(2, [7, 8, 9], 1), _sample(3, [4, 4], 1)])
    sub = batch.select([2, 1])
    assert sub.trajectory_ids == (3, 2)
    assert sub.input_ids.tolist() == [[4, 4, 0], [7, 8, 9]]
    assert sub.loss_mask.tolist() == [[True, False], [True, True]]
    assert sub.versions.tolist() == [[4, PAD_VERSION], [4, 3]]


def test_pad_id_equal_to_a_real_token_does_not_shorten_a_row() -> None:
    batch = collate([_sample(1, [0, 0, 0, 0], 1), _sample(2, [1, 2], 1)], pad_id=0)
    assert batch.select([0]).input_ids.shape == (1, 4)


def test_a_masked_first_token_is_not_trained_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    sample = _sample(1, [1, 2, 3], prompt_len=0)
    with caplog.at_level(logging.WARNING):
        batch = collate([sample])
    assert batch.loss_mask.tolist() == [[True, True]]
    assert "first token" in caplog.text


def test_collate_rejects_empty_batches() -> None:
    with pytest.raises(ValueError):
        collate([])


def test_batched_logprobs_equal_token_by_token_logprobs(tiny_model_dir: Path) -> None:
    """The batch's shifted alignment gives each token the logprob the model assigned it when it was
    next: checked against prefix-by-prefix forwards, for a padded row too."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    sequences = [[11, 42, 97, 300, 5, 18, 77], [64, 3, 250, 9]]
    batch = collate(
        [
            _sample(i, seq, 2, temperature=t)
            for i, (seq, t) in enumerate(zip(sequences, [1.0, 0.6], strict=True))
        ]
    )
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits[:, :-1]  # (B, T-1, V)
        batched = token_logprobs(logits, batch.targets, batch.temperatures)  # (B, T-1)
        for row, (seq, temperature) in enumerate(zip(sequences, [1.0, 0.6], strict=True)):
            for t in range(1, len(seq)):
                prefix_logits = model(input_ids=torch.tensor([seq[:t]])).logits[0, -1]  # (V,)
                expected = torch.log_softmax(prefix_logits / temperature, dim=-1)[seq[t]]
                assert batched[row, t - 1].item() == pytest.approx(expected.item(), abs=1e-5)
