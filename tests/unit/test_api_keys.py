"""API keys at rest and at the door: the keyed hash and where its secret comes from (storage/keys.py), the
rule for client-chosen AReaL keys, the `flywheel keys` command line, and the secret kept out of
printed config."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import uuid
from pathlib import Path

import pytest

from flywheel.cli import build_parser
from flywheel.config import load_config
from proxy.errors import OpenAIError
from proxy.rl.operations import check_client_key
from storage.config import StorageConfig
from storage.keys import (
    KeyHasher,
    KeySecretError,
    legacy_key_hash,
    load_key_hasher,
    secret_file,
    sqlite_secret,
)

SECRET = b"a-server-secret-of-at-least-32-bytes!"


def test_the_stored_hash_is_an_hmac_that_differs_with_the_secret() -> None:
    key = "fw-admin-" + secrets.token_urlsafe(32)
    stored = KeyHasher(SECRET).hash(key)
    assert stored == hmac.new(SECRET, key.encode(), hashlib.sha256).hexdigest()
    assert len(stored) == 64 and stored == KeyHasher(SECRET).hash(key)  # fits key_hash; deterministic
    assert stored != KeyHasher(SECRET + b"?").hash(key)
    assert stored != legacy_key_hash(key) == hashlib.sha256(key.encode()).hexdigest()
    assert SECRET.decode() not in repr(KeyHasher(SECRET))
    with pytest.raises(ValueError):
        KeyHasher(b"short")


def test_sqlite_secret_is_made_once_beside_the_database_and_private(tmp_path: Path) -> None:
    database = tmp_path / "run" / "flywheel.db"
    config = StorageConfig(url=f"sqlite+aiosqlite:///{database}")
    first = load_key_hasher(config).hash("k")
    path = secret_file(database)
    assert path == tmp_path / "run" / "flywheel.db.key-secret"
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_key_hasher(config).hash("k") == first  # every later process reads the same secret
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no draft left behind
    configured = StorageConfig(url=config.url, key_secret="c" * 40)
    assert load_key_hasher(configured).hash("k") == KeyHasher(b"c" * 40).hash("k") != first


def test_processes_starting_at_once_agree_on_one_secret(tmp_path: Path) -> None:
    path = tmp_path / "flywheel.db.key-secret"
    start = threading.Barrier(8)
    seen: list[bytes] = []

    def read() -> None:
        start.wait()
        seen.append(sqlite_secret(path))

    threads = [threading.Thread(target=read) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 8 and len(set(seen)) == 1
    assert sorted(os.listdir(tmp_path)) == [path.name]


def test_postgres_without_a_key_secret_is_refused_with_what_to_set() -> None:
    url = "postgresql+asyncpg://flywheel@db.example/flywheel"
    with pytest.raises(KeySecretError, match="FLYWHEEL_STORAGE__KEY_SECRET"):
        load_key_hasher(StorageConfig(url=url))
    configured = StorageConfig(url=url, key_secret="p" * 32)
    assert load_key_hasher(configured).hash("k") == KeyHasher(b"p" * 32).hash("k")


def test_the_key_secret_is_masked_in_printed_config_and_must_be_long(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_STORAGE__KEY_SECRET", "s" * 40)
    config = load_config(None, [])
    assert config.storage.key_secret is not None and config.storage.key_secret.get_secret_value() == "s" * 40
    assert "s" * 40 not in str(config.model_dump(mode="json")) and "s" * 40 not in repr(config)
    with pytest.raises(ValueError, match="key_secret"):
        StorageConfig(key_secret="too-short")


@pytest.mark.parametrize("key", [
    "client-chosen-key-0123456789",  # 28 characters
    "a" * 64,
    "abababababababababababababababababababab",
    "0101201201234012340123401234012340123401",  # 5 distinct characters
])
def test_weak_client_chosen_keys_are_refused_naming_the_minimum(key: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        check_client_key(key)
    error = refused.value
    assert error.status == 400 and error.param == "api_key" and error.code == "weak_api_key"
    assert "32 characters" in error.message


@pytest.mark.parametrize("key", [
    secrets.token_hex(16), str(uuid.uuid4()), secrets.token_urlsafe(32),
    "fw-sess-" + secrets.token_urlsafe(32),
], ids=["hex", "uuid", "urlsafe", "session-style"])  # fixed ids: every test process collects the same tests
def test_random_client_chosen_keys_are_accepted(key: str) -> None:
    check_client_key(key)


def test_keys_command_line() -> None:
    parser = build_parser()
    args, extra = parser.parse_known_args(["keys", "revoke", "7", "storage.url=sqlite+aiosqlite:///x.db"])
    assert (args.command, args.action, args.key_id, args.overrides, extra) == (
        "keys", "revoke", 7, ["storage.url=sqlite+aiosqlite:///x.db"], []
    )
    args, _ = parser.parse_known_args(["keys", "list", "--kind", "online", "--limit", "5"])
    assert (args.action, args.kind, args.limit, args.overrides) == ("list", "online", 5, [])
    args, _ = parser.parse_known_args(["keys", "create", "--admin", "run.dir=/tmp/r"])
    assert args.admin and not args.online and args.overrides == ["run.dir=/tmp/r"]
    wrong_lines = (["keys"], ["keys", "create"], ["keys", "revoke", "x"], ["keys", "list", "--limit", "0"])
    for wrong in wrong_lines:
        with pytest.raises(SystemExit):
            parser.parse_known_args(wrong)
