"""The engine factory's URL handling, the config's strictness, and sequence rebuilding (no database)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from storage.config import StorageConfig
from storage.engine import create_engine
from storage.records import CompletionRecord
from storage.sequences import full_prompt_ids, full_token_ids


@pytest.mark.parametrize(
    "url", ["mysql+aiomysql://u@h/db", "sqlite:///sync-driver.db", "postgresql+psycopg://u@h/db"]
)
def test_unsupported_drivers_are_rejected(url: str) -> None:
    with pytest.raises(ValueError, match=r"unsupported database .* use sqlite\+aiosqlite:// or postgresql"):
        create_engine(StorageConfig(url=url))


@pytest.mark.parametrize("url", ["sqlite+aiosqlite://", "sqlite+aiosqlite:///:memory:"])
def test_in_memory_sqlite_is_rejected(url: str) -> None:
    with pytest.raises(ValueError, match="needs a SQLite file"):
        create_engine(StorageConfig(url=url))


async def test_sqlite_engine_creates_the_parent_folder(tmp_path: Path) -> None:
    target = tmp_path / "run" / "nested" / "flywheel.db"
    engine = create_engine(StorageConfig(url=f"sqlite+aiosqlite:///{target}"))
    await engine.dispose()
    assert target.parent.is_dir()


def test_postgres_engine_is_made_without_connecting() -> None:
    engine = create_engine(StorageConfig(url="postgresql+asyncpg://nobody@127.0.0.1:1/none", pool_size=3))
    assert engine.dialect.name == "postgresql" and engine.pool.size() == 3  # type: ignore[attr-defined]


def test_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValidationError):
        StorageConfig(url="sqlite+aiosqlite:///x.db", pool=4)  # type: ignore[call-arg]


def _c(cid: str, parent: str | None, prompt: list[int], out: list[int]) -> CompletionRecord:
    return CompletionRecord(
        id=cid,
        session_id="s",
        parent_id=parent,
        prompt_ids=np.array(prompt, dtype=np.int32),
        output_ids=out,
        output_logprobs=[0.0] * len(out),
        output_versions=[0] * len(out),
        finish_reason="stop",
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        request_json={},
        response_json={},
    )


def test_full_sequences_interleave_suffixes_and_outputs() -> None:
    chain = [_c("a", None, [1, 2], [3]), _c("b", "a", [4], [5, 6]), _c("c", "b", [], [7])]
    assert full_prompt_ids(chain).tolist() == [1, 2, 3, 4, 5, 6]
    assert full_token_ids(chain).tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert full_token_ids(chain[:1]).dtype == np.int32


@pytest.mark.parametrize(
    "chain",
    [
        [],
        [_c("b", "a", [1], [2])],  # does not start at a root
        [_c("a", None, [1], [2]), _c("c", "b", [3], [4])],  # a link is missing
    ],
)
def test_broken_chains_are_errors(chain: list[CompletionRecord]) -> None:
    with pytest.raises(ValueError):
        full_prompt_ids(chain)
