"""Reading recorded completions back as the worker saw them: a completion with a parent stores only its
prompt suffix (docs/architecture.md, "Storage"), so the prompt the worker got is rebuilt from the chain;
and what a completion of the default scripted worker must hold."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from storage.models import Completion
from storage.queries import completion_record
from storage.sequences import full_prompt_ids as chain_prompt_ids
from tests.support.proxy_harness import Proxy
from tests.support.scripted_worker import ScriptedWorker, token_logprob, token_text
from tests.support.text_script import TextScript


def full_prompt_ids(rows: Sequence[Completion], row: Completion) -> list[int]:
    """The whole prompt `row` was sampled from, given all rows of its session."""
    by_id = {r.id: r for r in rows}
    chain = [row]
    while chain[0].parent_id is not None:
        chain.insert(0, by_id[chain[0].parent_id])
    return [int(t) for t in chain_prompt_ids([completion_record(r) for r in chain])]


def assert_token_exact(rows: Sequence[Completion], worker: ScriptedWorker, script: TextScript) -> None:
    """Each row is one /generate call of the worker (same ids): its rebuilt prompt is the
    input_ids the worker received and its output the ids the script generated, eos included, with a
    logprob and a policy version per output token."""
    sent = {r.body["rid"]: r.body for r in worker.requests_to("/generate")}
    assert sorted(row.id for row in rows) == sorted(sent)
    for row in rows:
        assert full_prompt_ids(rows, row) == sent[row.id]["input_ids"], row.id
        assert row.output_ids.tolist() == script.output_ids(sent[row.id]["input_ids"]), row.id
        assert int(row.output_ids[-1]) == script.eos
        assert len(row.output_logprobs) == len(row.output_versions) == len(row.output_ids)


def output_text(row: Completion, script: TextScript) -> str:
    """What the row's output spells, without the closing eos."""
    return str(script.tokenizer.decode(row.output_ids.tolist()[:-1]))


def scripted_text(output_ids: Any) -> str:
    """What the scripted worker's tokens spell (its detokeniser)."""
    return "".join(token_text(int(t)) for t in output_ids)


def assert_recorded(proxy: Proxy, completion_id: str, text: str, *, session_id: str | None = None) -> Any:
    """The completion spells `text` in the default scripted worker's tokens, with that worker's logprobs
    and a policy version per token, in the proxy's session (or `session_id`)."""
    row = proxy.completion(completion_id)
    assert scripted_text(row.output_ids) == text
    expected = [token_logprob(int(t), i) for i, t in enumerate(row.output_ids)]
    assert row.output_logprobs.tolist() == pytest.approx(expected, abs=1e-6)  # float32 storage
    assert len(row.output_versions) == len(row.output_ids)
    assert row.session_id == (session_id or proxy.session_id)
    return row
