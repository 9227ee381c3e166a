"""The padded KV cache: prefilling, merging and dropping rows leave each row's logits what they are alone."""

from __future__ import annotations

import pytest
import torch

from serving.engine.batch import HEADROOM, PaddedBatch, PaddedKVCache, merge, prefill_inputs, prefilled_batch


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def forward(model, input_ids, positions, mask, cache):
    with torch.no_grad():
        out = model(input_ids=input_ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :]


def prefill(model, prompts):
    input_ids, positions, mask, row_mask = prefill_inputs(prompts, torch.float32)
    cache = PaddedKVCache(len(prompts), input_ids.shape[1] + HEADROOM)
    logits = forward(model, input_ids, positions, mask, cache)
    cache.length = input_ids.shape[1]
    tokens = logits.argmax(-1).tolist()
    return prefilled_batch(cache, row_mask, prompts, tokens), tokens


def step(model, batch: PaddedBatch):
    input_ids, positions, mask = batch.decode_inputs()
    logits = forward(model, input_ids, positions, mask, batch.cache)
    tokens = logits.argmax(-1).tolist()
    batch.advance(tokens)
    return logits, tokens


def reference_logits(model, ids):
    """Logits after every prefix of `ids`, from one plain forward: (len(ids), V)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_rows_decode_as_if_alone_through_merges_growth_and_retirement(model):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23]]
    histories = [list(p) for p in prompts]
    seen: list[list[torch.Tensor]] = [[], [], []]  # logits the batch produced after each history token

    def record(rows, logits, tokens):
        for slot, row in enumerate(rows):
            seen[row].append(logits[slot])
            histories[row].append(tokens[slot])

    batch, first = prefill(model, prompts[:2])  # two rows of different lengths, left-padded together
    for history, token in zip(histories, first, strict=False):
        history.append(token)
    for _ in range(3):
        record([0, 1], *step(model, batch))
    late, late_first = prefill(model, prompts[2:])  # a row joining mid-decode, shorter than the batch
    histories[2].append(late_first[0])
    batch = merge(batch, late)
    for _ in range(HEADROOM + 2):  # runs past the preallocated columns: the buffers must grow
        record([0, 1, 2], *step(model, batch))
    kept = batch.keep([1, 2])  # the longest row leaves: leading padding columns are trimmed
    assert kept is not None and kept.size == 2
    record([1, 2], *step(model, kept))
    assert kept.keep([]) is None
    for row, prompt in enumerate(prompts):
        reference = reference_logits(model, histories[row][:-1])
        start = len(prompt)  # seen[row][i] came after history[: start + i + 1]
        for i, logits in enumerate(seen[row]):
            assert torch.allclose(logits, reference[start + i], atol=1e-4), (row, i)


def test_merge_into_a_shorter_batch_shifts_the_old_rows(model):
    short, first = prefill(model, [[3, 4]])
    long, long_first = prefill(model, [[30, 31, 32, 33, 34, 35, 36, 37, 38]])
    batch = merge(short, long)
    logits, _ = step(model, batch)
    assert torch.allclose(logits[0], reference_logits(model, [3, 4, first[0]])[-1], atol=1e-4)
    long_history = [30, 31, 32, 33, 34, 35, 36, 37, 38, long_first[0]]
    assert torch.allclose(logits[1], reference_logits(model, long_history)[-1], atol=1e-4)
