"""API keys at rest: the keyed hash stored in place of a bearer key, the server secret it is keyed with,
and the queries on the key table that need either (find, with the legacy upgrade; list; revoke).

A key is stored as HMAC-SHA256(secret, key) in hex (`KeyHasher`), so that a copy of the database alone
does not let anyone test guesses of a key offline. Every process on one database (every proxy, the
CLI, the trainer) must hash with the same secret; `load_key_hasher` finds it:

- `storage.key_secret` when set: deployments, and any database shared across machines;
- else, on SQLite, a secret generated once into `<database file>.key-secret` (mode 0600), which every
  process opening that database reads, so the embedded default works with no configuration;
- else (Postgres) none: `KeySecretError`. A secret generated into the database it protects would
  protect nothing if that database leaked, so a Postgres deployment sets one
  (docker-compose.yml shows how).

Rows written before keyed hashing hold sha256(key) (`hash_scheme` 'sha256'). `find_key` matches those
too, in the same query, and rewrites such a row, and `sessions.owner_key_hash` of the sessions its online
key owns, to the keyed hash in one transaction, so an old key keeps working and keeps its sessions.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import and_, make_url, or_, select, update

from storage.config import MIN_KEY_SECRET_CHARS, StorageConfig, StorageSetupError
from storage.engine import SQLITE_DRIVER, SessionFactory, write_transaction
from storage.models import ApiKey, KeyHashScheme, KeyScope, Session, as_utc

logger = logging.getLogger(__name__)

SECRET_FILE_SUFFIX = ".key-secret"


class KeySecretError(StorageSetupError):
    """No key secret can be found for this database (a Postgres one without `storage.key_secret`)."""


class LastAdminKeyError(ValueError):
    """Revoking this key would leave no unrevoked admin key: nobody could manage the others."""


@dataclass(frozen=True, slots=True)
class KeyHasher:
    """Turns a bearer key into what is stored for it. Built once per process (`load_key_hasher`) and
    handed to whatever stores or looks up keys; it never appears in a repr or a log."""

    secret: bytes = field(repr=False)
    _keyed: hmac.HMAC = field(init=False, repr=False, compare=False)
    """An HMAC with the secret already keyed in: every request hashes its key, and a copy of it costs a
    third less than keying a new one (`hmac.digest`)."""

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_KEY_SECRET_CHARS:
            raise ValueError(f"a key secret needs at least {MIN_KEY_SECRET_CHARS} bytes")
        object.__setattr__(self, "_keyed", hmac.new(self.secret, digestmod=hashlib.sha256))

    def hash(self, key: str) -> str:
        """The keyed hash stored for `key`: HMAC-SHA256 with the secret, 64 hex characters."""
        keyed = self._keyed.copy()
        keyed.update(key.encode())
        return keyed.hexdigest()


def legacy_key_hash(key: str) -> str:
    """The unkeyed sha256 digest rows written before keyed hashing hold; only ever looked up, never
    written."""
    return hashlib.sha256(key.encode()).hexdigest()


def load_key_hasher(config: StorageConfig) -> KeyHasher:
    """The hasher every process on `config`'s database shares (see the module docstring for where its
    secret comes from); `KeySecretError` for a Postgres database without `storage.key_secret`."""
    if config.key_secret is not None:
        return KeyHasher(config.key_secret.get_secret_value().encode())
    url = make_url(config.url)
    if url.drivername != SQLITE_DRIVER or not url.database or url.query.get("uri"):
        raise KeySecretError(
            "storage.key_secret is not set: every process on this database must hash API keys with the same "
            "secret, which is not kept in the database (only a SQLite file gets one generated beside it). "
            "Set FLYWHEEL_STORAGE__KEY_SECRET (at least "
            f"{MIN_KEY_SECRET_CHARS} characters, e.g. `openssl rand -hex 32`) for every proxy, trainer and "
            "`flywheel keys` on this database."
        )
    return KeyHasher(sqlite_secret(secret_file(Path(url.database))))


def secret_file(database: Path) -> Path:
    """Where the generated secret of the SQLite database at `database` lives."""
    return database.with_name(database.name + SECRET_FILE_SUFFIX)


def sqlite_secret(path: Path) -> bytes:
    """The secret in `path`, generated there first if there is none. Several processes may start at
    once: the secret is written whole to a private file and hard-linked into place, so exactly one
    is kept and no reader ever sees a partial one."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        draft = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        descriptor = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(descriptor, "w") as out:
                out.write(secrets.token_hex(32) + "\n")
            os.link(draft, path)
            logger.info("generated the API key secret %s", path)
        except FileExistsError:
            pass  # another process made it first: use theirs
        finally:
            draft.unlink(missing_ok=True)
    if path.stat().st_mode & 0o077:
        logger.warning("%s is readable by other users: anyone who can read it and the database can test "
                       "guesses of API keys offline (chmod 600 it)", path)
    secret = path.read_text().strip()
    if len(secret) < MIN_KEY_SECRET_CHARS:
        raise KeySecretError(f"{path} holds no usable key secret (fewer than {MIN_KEY_SECRET_CHARS} "
                             "characters); restore it, or remove it to make a new one (which invalidates "
                             "every key made since it was written)")
    return secret.encode()


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """A key's own limits (`api_keys.requests_per_s`, `burst`, `tokens_per_day`); None: its kind's."""

    requests_per_s: float | None = None
    burst: int | None = None
    tokens_per_day: int | None = None


NO_KEY_LIMITS = KeyLimits()


@dataclass(frozen=True, slots=True, kw_only=True)
class FoundKey:
    """A stored key matched by its plaintext; `key_hash` is always its keyed hash."""

    id: int
    key_hash: str
    scope: str
    session_id: str | None
    session_status: str | None  # of a session key's session
    revoked: bool
    limits: KeyLimits = NO_KEY_LIMITS
    """The key's own rate limits (None where its kind's defaults apply)."""



@dataclass(frozen=True, slots=True, kw_only=True)
class KeyInfo:
    """What may be shown about a stored key: never its hash."""

    id: int
    scope: str
    created_at: datetime
    revoked_at: datetime | None
    session_id: str | None


async def find_key(
    session_factory: SessionFactory, hasher: KeyHasher, key: str, *, include_revoked: bool = False
) -> FoundKey | None:
    """The stored key `key` is, by its keyed hash or, for a row written before keyed hashing, its
    legacy sha256 (in one query); such a row is rewritten to the keyed hash on the way. None if there is
    none, or it is revoked (unless `include_revoked`)."""
    keyed, legacy = hasher.hash(key), legacy_key_hash(key)
    query = (
        select(ApiKey.id, ApiKey.key_hash, ApiKey.scope, ApiKey.session_id, ApiKey.revoked_at, Session.status,
               ApiKey.requests_per_s, ApiKey.burst, ApiKey.tokens_per_day)
        .outerjoin(Session, Session.id == ApiKey.session_id)
        .where(or_(
            ApiKey.key_hash == keyed,
            and_(ApiKey.key_hash == legacy, ApiKey.hash_scheme == KeyHashScheme.LEGACY_SHA256.value),
        ))
    )
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    async with session_factory() as db:
        rows = (await db.execute(query)).all()
    if not rows:
        return None
    row = next((r for r in rows if r.key_hash == keyed), rows[0])
    if row.key_hash != keyed:
        await upgrade_legacy_hash(session_factory, legacy, keyed)
    return FoundKey(id=row.id, key_hash=keyed, scope=row.scope, session_id=row.session_id,
                    session_status=row.status, revoked=row.revoked_at is not None,
                    limits=KeyLimits(row.requests_per_s, row.burst, row.tokens_per_day))


async def upgrade_legacy_hash(session_factory: SessionFactory, legacy: str, keyed: str) -> None:
    """Rewrite a legacy sha256 key row, and the sessions its online key owns, to the keyed hash, in one
    transaction (so the key never loses its sessions). Idempotent: another process may have done it."""
    async with write_transaction(session_factory) as db:
        await db.execute(
            update(ApiKey)
            .where(ApiKey.key_hash == legacy, ApiKey.hash_scheme == KeyHashScheme.LEGACY_SHA256.value)
            .values(key_hash=keyed, hash_scheme=KeyHashScheme.HMAC_SHA256.value)
        )
        await db.execute(update(Session).where(Session.owner_key_hash == legacy).values(owner_key_hash=keyed))
    logger.info("an API key stored as a legacy sha256 digest now has its keyed hash")


async def list_keys(
    session_factory: SessionFactory, *, scope: str | None = None, limit: int = 100
) -> list[KeyInfo]:
    """Stored keys, newest first (`scope` only, when given), at most `limit`."""
    query = select(ApiKey).order_by(ApiKey.id.desc()).limit(limit)
    if scope is not None:
        query = query.where(ApiKey.scope == scope)
    async with session_factory() as db:
        return [_info(row) for row in (await db.execute(query)).scalars()]


async def revoke_key(session_factory: SessionFactory, key_id: int) -> KeyInfo:
    """Revoke a key by id: from then on it no longer authenticates (a proxy that cached it stops
    accepting it within its `proxy.key_cache_ttl_s`). Idempotent: a revoked key stays as it was.
    LookupError for an unknown id; LastAdminKeyError for the last unrevoked admin key."""
    async with write_transaction(session_factory) as db:
        scope = await db.scalar(select(ApiKey.scope).where(ApiKey.id == key_id))
        if scope is None:
            raise LookupError(f"no API key {key_id}")
        if scope == KeyScope.ADMIN.value:
            # Lock every unrevoked admin key, in one order, before counting them: two revocations of
            # the last two admin keys on Postgres then run one after the other (SQLite: BEGIN IMMEDIATE).
            admins = (await db.execute(
                select(ApiKey.id)
                .where(ApiKey.scope == KeyScope.ADMIN.value, ApiKey.revoked_at.is_(None))
                .order_by(ApiKey.id)
                .with_for_update()
            )).scalars().all()
            if list(admins) == [key_id]:
                raise LastAdminKeyError(
                    f"API key {key_id} is the last unrevoked admin key: create another admin key first "
                    "(`flywheel keys create --admin`)"
                )
        row = (await db.execute(select(ApiKey).where(ApiKey.id == key_id).with_for_update())).scalar_one()
        if row.revoked_at is None:
            row.revoked_at = datetime.now(UTC)
            logger.info("API key %d (%s) revoked", key_id, row.scope)
        return _info(row)


def _info(row: ApiKey) -> KeyInfo:
    revoked_at = None if row.revoked_at is None else as_utc(row.revoked_at)
    return KeyInfo(id=row.id, scope=row.scope, created_at=as_utc(row.created_at), revoked_at=revoked_at,
                   session_id=row.session_id)


