"""A token function for the scripted worker that spells a reply to the rendered prompt with the served
tokenizer, then <|im_end|>: tests script what the "model" says while every token id stays real."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

from transformers import AutoTokenizer


class TextScript:
    """`reply(prompt_text) -> answer_text` (with `per_sample`, `reply(prompt_text, sample_index)`, so the
    choices of an n > 1 call differ); pass the instance as the scripted worker's `token_fn` and `text` as
    its `token_text`. Every prompt seen is kept in `prompts`."""

    def __init__(
        self, model_dir: Path, reply: Callable[[str], str] | Callable[[str, int], str],
        per_sample: bool = False,
    ) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.per_sample = per_sample
        if per_sample:
            self._reply = cast(Callable[[str, int], str], reply)
        else:
            whole = cast(Callable[[str], str], reply)
            self._reply = lambda prompt, _index: whole(prompt)
        self.prompts: list[str] = []
        self._cache: dict[tuple[tuple[int, ...], int], list[int]] = {}
        self._lock = threading.Lock()

    def output_ids(self, prompt_ids: Sequence[int], index: int = 0) -> list[int]:
        key = (tuple(prompt_ids), index if self.per_sample else 0)
        with self._lock:
            if key not in self._cache:
                prompt = self.tokenizer.decode(list(prompt_ids))
                self.prompts.append(prompt)
                text = self._reply(prompt, index)
                self._cache[key] = [*self.tokenizer.encode(text, add_special_tokens=False), self.eos]
            return self._cache[key]

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def __call__(self, prompt_ids: Sequence[int], position: int, index: int, seed: int) -> int:
        ids = self.output_ids(prompt_ids, index)
        return ids[min(position, len(ids) - 1)]
