"""Storage sub-config: which database the proxy, finalizer and trainer share, and how to connect."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

SUPPORTED_SCHEMES = ("sqlite+aiosqlite://", "postgresql+asyncpg://")
MIN_KEY_SECRET_CHARS = 32


class StorageSetupError(RuntimeError):
    """The database cannot be used as configured (its schema is not this Flywheel's, or no key secret is
    set where one must be); the message says what to do. Entry points print it and exit."""


class StorageConfig(BaseModel):
    """The database connection (embedded in the root config as `storage`)."""

    model_config = ConfigDict(extra="forbid")

    url: str = "sqlite+aiosqlite:///flywheel-run/flywheel.db"
    """`sqlite+aiosqlite:///path/to/file.db` (embedded default; the parent folder is created) or
    `postgresql+asyncpg://user:password@host:port/dbname` (production, several writers)."""
    echo: bool = False
    """Log every SQL statement (SQLAlchemy's `echo`); for debugging only."""
    pool_size: int = Field(10, ge=1)
    """Connections kept open per process."""
    sqlite_busy_timeout_ms: int = Field(30000, ge=0)
    """How long a SQLite writer waits for another writer's lock before failing with 'database is locked'."""
    sqlite_synchronous: Literal["NORMAL", "FULL"] = "NORMAL"
    """SQLite's fsync policy. In WAL mode NORMAL keeps every committed transaction when a process
    crashes (a `kill -9`d proxy loses nothing it answered) and only a power loss or OS crash can drop
    the last commits; it saves an fsync per commit, which is most of the proxy's recording cost.
    FULL also survives power loss."""
    key_secret: SecretStr | None = Field(None, min_length=MIN_KEY_SECRET_CHARS)
    """The server secret API keys are hashed with (HMAC-SHA256; storage/keys.py). Every process on one
    database (every proxy, the CLI, the trainer) must use the same one, and changing it invalidates
    every key made since it was set. Unset on SQLite: a secret generated once into a 0600 file beside
    the database (`<database>.key-secret`). Unset on Postgres: processes refuse to start, since a
    secret kept in the database it protects would protect nothing if that database leaked. Set it
    from the environment (`FLYWHEEL_STORAGE__KEY_SECRET`, e.g. `openssl rand -hex 32`), not a file
    others can read; `flywheel config` prints it masked."""

    @field_validator("url")
    @classmethod
    def _supported_driver(cls, url: str) -> str:
        if not url.startswith(SUPPORTED_SCHEMES):
            scheme = url.split("://", 1)[0]
            raise ValueError(f"unsupported database {scheme!r}: use {' or '.join(SUPPORTED_SCHEMES)}")
        return url
