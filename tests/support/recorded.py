"""Reading recorded completions back as the worker saw them: a completion with a parent stores only its
prompt suffix (DESIGN.md section 3), so the prompt the worker got is rebuilt from the chain."""

from __future__ import annotations

from collections.abc import Sequence

from storage.models import Completion
from storage.queries import completion_record
from storage.sequences import full_prompt_ids as chain_prompt_ids
from tests.support.scripted_worker import ScriptedWorker
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
