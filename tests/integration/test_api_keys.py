"""API keys across processes, on SQLite and Postgres: keys stored before keyed hashing keep working
and are rehashed in place (an online key keeping its sessions), and a revocation, through the route or
`flywheel keys revoke`, stops a key at once on the proxy that revoked it and within
`proxy.key_cache_ttl_s` on every other; `flywheel keys list` shows no secret."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
from sqlalchemy import select

from proxy.auth import (
    ADMIN_KEY_PREFIX,
    ONLINE_KEY_PREFIX,
    create_admin_key,
    create_online_key,
    generate_api_key,
)
from storage.engine import SessionFactory, write_transaction
from storage.keys import KeyHasher, legacy_key_hash, list_keys, revoke_key
from storage.migrate import upgrade
from storage.models import ApiKey, KeyHashScheme, Session
from tests.support.cli import flywheel
from tests.support.databases import TEST_KEY_SECRET, key_hasher, run_outside_loop, storage_overrides
from tests.support.proxy_harness import Proxy, ProxyFactory, run_db
from tests.support.scripted_worker import ScriptedWorker

# The two tables as revision 0003 has them (the ORM models are at head).
_KEYS_0003 = sa.table("api_keys", sa.column("key_hash"), sa.column("scope"), sa.column("session_id"))
_SESSIONS_0003 = sa.table("sessions", sa.column("id"), sa.column("metadata", sa.JSON),
                          sa.column("owner_key_hash"), sa.column("status"))


def rl(proxy: Proxy, method: str, path: str, key: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.request(method, f"{proxy.base_url}{path}", json=body,
                         headers={"Authorization": f"Bearer {key}"})


def key_id(proxy: Proxy, kind: str) -> int:
    """The id of the newest key of `kind`."""
    listed = rl(proxy, "GET", f"/rl/v1/keys?kind={kind}&limit=1", proxy.admin_key)
    return int(listed.json()["data"][0]["id"])


def wait_refused(proxy: Proxy, key: str, within_s: float) -> float:
    """Seconds until `key` is refused (401) on `proxy`; fails past `within_s`."""
    started = time.monotonic()
    while (status := rl(proxy, "GET", "/rl/v1/policy", key).status_code) == 200:
        assert time.monotonic() - started < within_s, f"key still accepted after {within_s} s"
        time.sleep(0.05)
    assert status == 401
    return time.monotonic() - started


async def _write_0003_rows(session_factory: SessionFactory, admin_key: str, online_key: str) -> None:
    async with write_transaction(session_factory) as db:
        await db.execute(sa.insert(_KEYS_0003).values(key_hash=legacy_key_hash(admin_key), scope="admin"))
        await db.execute(sa.insert(_KEYS_0003).values(key_hash=legacy_key_hash(online_key), scope="online"))
        await db.execute(sa.insert(_SESSIONS_0003).values(
            id="sess_legacy", metadata={"origin": "online"}, owner_key_hash=legacy_key_hash(online_key),
            status="active",
        ))
        await db.execute(sa.insert(_KEYS_0003).values(
            key_hash=legacy_key_hash("never-handed-out"), scope="session", session_id="sess_legacy"
        ))


async def _key_rows(session_factory: SessionFactory) -> dict[str, tuple[str, str]]:
    async with session_factory() as db:
        rows = (await db.execute(select(ApiKey.scope, ApiKey.key_hash, ApiKey.hash_scheme))).all()
    return {f"{row.scope}:{row.key_hash}": (row.scope, row.hash_scheme) for row in rows}


async def _owner(session_factory: SessionFactory) -> str | None:
    async with session_factory() as db:
        return await db.scalar(select(Session.owner_key_hash).where(Session.id == "sess_legacy"))


def test_legacy_sha256_keys_authenticate_and_are_rehashed_in_place(
    empty_db_url: str, tiny_model_dir: Path, scripted: ScriptedWorker
) -> None:
    run_outside_loop(upgrade, empty_db_url, "0003")
    admin_key, online_key = generate_api_key(ADMIN_KEY_PREFIX), generate_api_key(ONLINE_KEY_PREFIX)
    run_db(empty_db_url, lambda factory: _write_0003_rows(factory, admin_key, online_key))
    run_outside_loop(upgrade, empty_db_url)
    legacy = run_db(empty_db_url, _key_rows)
    assert {scheme for _, scheme in legacy.values()} == {KeyHashScheme.LEGACY_SHA256.value}

    hasher = key_hasher(empty_db_url)
    factory = ProxyFactory(empty_db_url, tiny_model_dir)
    with factory.stack:
        proxy = factory.start([scripted.url], key_cache_ttl_s=0)
        assert rl(proxy, "GET", "/rl/v1/keys", admin_key).status_code == 200
        rows = run_db(empty_db_url, _key_rows)
        assert rows[f"admin:{hasher.hash(admin_key)}"] == ("admin", KeyHashScheme.HMAC_SHA256.value)
        assert f"admin:{legacy_key_hash(admin_key)}" not in rows
        # New keys (the harness's) are keyed; still legacy: the online key, not used yet, and the session
        # key nobody ever presents.
        assert [scheme for _, scheme in rows.values()].count(KeyHashScheme.LEGACY_SHA256.value) == 2
        assert rl(proxy, "GET", "/rl/v1/keys", admin_key).status_code == 200  # now by its keyed hash

        # The online key is rehashed together with the sessions it owns: it still acts on them.
        assert run_db(empty_db_url, _owner) == legacy_key_hash(online_key)
        rewarded = rl(proxy, "POST", "/rl/v1/sessions/sess_legacy/reward", online_key, {"value": 1.0})
        assert rewarded.status_code == 200, rewarded.text
        assert run_db(empty_db_url, _owner) == hasher.hash(online_key)
        assert rl(proxy, "POST", "/rl/v1/sessions/sess_legacy/end", online_key).json()["ended"] is True
        assert rl(proxy, "GET", "/rl/v1/policy", legacy_key_hash(admin_key)).status_code == 401


def test_a_revocation_is_immediate_on_the_revoking_proxy_and_bounded_by_the_ttl_elsewhere(
    proxies: ProxyFactory, scripted: ScriptedWorker, db_url: str
) -> None:
    ttl_s = 1.0
    revoking = proxies.start([scripted.url], key_cache_ttl_s=3600)  # only the cache's clearing is immediate
    other = proxies.start([scripted.url], key_cache_ttl_s=ttl_s)
    hasher = key_hasher(db_url)
    online_key = run_db(db_url, lambda factory: create_online_key(factory, hasher))
    for proxy in (revoking, other):
        assert rl(proxy, "GET", "/rl/v1/policy", online_key).status_code == 200  # cached on both

    revoked = rl(revoking, "POST", f"/rl/v1/keys/{key_id(revoking, 'online')}/revoke", revoking.admin_key)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert rl(revoking, "GET", "/rl/v1/policy", online_key).status_code == 401
    assert wait_refused(other, online_key, within_s=ttl_s + 1.0) <= ttl_s + 1.0


def test_keys_list_and_revoke_on_the_command_line(
    proxies: ProxyFactory, scripted: ScriptedWorker, db_url: str, tmp_path: Path
) -> None:
    ttl_s = 1.0
    proxy = proxies.start([scripted.url], key_cache_ttl_s=ttl_s)
    storage = storage_overrides(db_url)
    created = flywheel("keys", "create", "--online", *storage, cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    online_key = created.stdout.strip().splitlines()[-1]
    assert rl(proxy, "GET", "/rl/v1/policy", online_key).status_code == 200

    listed = flywheel("keys", "list", "--kind", "online", *storage, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.strip().splitlines()
    assert header.split() == ["ID", "KIND", "CREATED", "(UTC)", "REVOKED", "(UTC)", "SESSION"]
    hasher = key_hasher(db_url)
    for secret in (online_key, proxy.admin_key, proxy.session_key):
        assert secret not in listed.stdout and hasher.hash(secret) not in listed.stdout
    online_id, kind, *_ = row.split()
    assert kind == "online" and row.split()[-2:] == ["-", "-"]  # not revoked, no session

    revoked = flywheel("keys", "revoke", online_id, *storage, cwd=tmp_path)
    assert revoked.returncode == 0, revoked.stderr
    assert f"key {online_id} (online) revoked" in revoked.stdout
    wait_refused(proxy, online_key, within_s=ttl_s + 1.0)

    last_admin = flywheel("keys", "revoke", str(key_id(proxy, "admin")), *storage, cwd=tmp_path)
    assert last_admin.returncode == 1 and "last unrevoked admin key" in last_admin.stderr
    unknown = flywheel("keys", "revoke", "999999", *storage, cwd=tmp_path)
    assert unknown.returncode == 1 and "no API key 999999" in unknown.stderr
    assert "Traceback" not in last_admin.stderr + unknown.stderr


async def test_concurrent_revocations_never_leave_no_admin_key(session_factory: SessionFactory) -> None:
    hasher = KeyHasher(TEST_KEY_SECRET.encode())
    for _ in range(2):
        await create_admin_key(session_factory, hasher)
    ids = [info.id for info in await list_keys(session_factory, scope="admin")]
    outcomes = await asyncio.gather(*(revoke_key(session_factory, i) for i in ids), return_exceptions=True)
    assert sorted(type(outcome).__name__ for outcome in outcomes) == ["KeyInfo", "LastAdminKeyError"]
    admins = await list_keys(session_factory, scope="admin")
    assert [info.revoked_at for info in admins].count(None) == 1
