"""API-key auth (`Authorization: Bearer <key>`, or `x-api-key: <key>` as Anthropic's clients send it): keys
are stored only as keyed hashes (storage/keys.py) with a scope (admin, online, or one session).

FastAPI dependencies:
- `require_principal`: OpenAI routes. The key must exist, be unrevoked and, for a session key, belong
  to a session that is still active: a session's key stops working for inference once it has ended.
- `require_key`: RL control routes. Like `require_principal`, but a session key of an ended session
  still authenticates (rewards may arrive after the end); the route decides what it may do.
- `require_admin`: admin-only routes (403 for a session key).

`may_act_on` is the one ownership check of sessions and what they hold (their RL routes, their stored
Responses).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Depends, Request

from proxy.errors import OpenAIError
from storage.engine import SessionFactory
from storage.keys import NO_KEY_LIMITS, KeyHasher, KeyLimits, find_key
from storage.models import KeyScope, SessionStatus
from storage.queries import create_admin_key as store_admin_key
from storage.queries import create_online_key as store_online_key
from storage.queries import session_owner

ADMIN_KEY_PREFIX = "fw-admin-"
SESSION_KEY_PREFIX = "fw-sess-"
ONLINE_KEY_PREFIX = "fw-online-"

Scope = Literal["admin", "session", "online"]


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: an admin, the holder of one session's key, or of an online key (whose calls join
    the sessions it owns by conversation: proxy/conversations/online.py)."""

    scope: Scope
    session_id: str | None
    key_hash: str | None = None  # set for an online key (its keyed hash): the owner of its sessions
    key_id: int | None = None
    """The key's row (`api_keys.id`): what its rate limits and token quota count against."""
    limits: KeyLimits = NO_KEY_LIMITS
    """The key's own limits, where it has any (proxy/rate_limits.py)."""

    @property
    def is_admin(self) -> bool:
        return self.scope == "admin"


async def may_act_on(session_factory: SessionFactory, principal: Principal, session_id: str) -> bool:
    """Whether `principal` may act on a session and what it holds: an admin on any, a session key on its
    own, an online key on the sessions its calls made (`sessions.owner_key_hash`, read only for it)."""
    if principal.is_admin or principal.session_id == session_id:
        return True
    return principal.key_hash is not None and principal.key_hash == await session_owner(
        session_factory, session_id
    )


@dataclass(frozen=True, slots=True)
class KeyLookup:
    """A stored key and, for a session key, whether its session is still active."""

    principal: Principal
    session_active: bool


class KeyCache:
    """Keys recently found valid and active, by keyed hash, so a busy agent costs one database
    lookup per `ttl_s` instead of one per call. Only positive answers are kept. The app clears it
    whenever an RL control call changes state (a session ended, a key rebound), so those take effect
    at once; a change made by another process takes effect within `ttl_s`. `ttl_s = 0` disables it."""

    def __init__(self, ttl_s: float, max_entries: int = 65536) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, KeyLookup]] = {}

    def get(self, key_hash: str) -> KeyLookup | None:
        entry = self._entries.get(key_hash)
        if entry is None:
            return None
        if entry[0] < time.monotonic():
            del self._entries[key_hash]
            return None
        return entry[1]

    def put(self, key_hash: str, lookup: KeyLookup) -> None:
        if self.ttl_s <= 0 or not lookup.session_active:
            return
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[key_hash] = (time.monotonic() + self.ttl_s, lookup)

    def clear(self) -> None:
        self._entries.clear()


def generate_api_key(prefix: str) -> str:
    """A new bearer key: `prefix` then 43 url-safe characters (256 random bits)."""
    return f"{prefix}{secrets.token_urlsafe(32)}"


async def create_admin_key(
    session_factory: SessionFactory, hasher: KeyHasher, limits: KeyLimits = NO_KEY_LIMITS
) -> str:
    """Store a new admin key (hashed, with its own `limits`) and return its plaintext: the only time
    anyone sees it."""
    key = generate_api_key(ADMIN_KEY_PREFIX)
    await store_admin_key(session_factory, hasher.hash(key), limits)
    return key


async def create_online_key(
    session_factory: SessionFactory, hasher: KeyHasher, limits: KeyLimits = NO_KEY_LIMITS
) -> str:
    """Store a new online key (hashed, with its own `limits`) and return its plaintext: the only time
    anyone sees it."""
    key = generate_api_key(ONLINE_KEY_PREFIX)
    await store_online_key(session_factory, hasher.hash(key), limits)
    return key


async def lookup_key(session_factory: SessionFactory, hasher: KeyHasher, key: str) -> KeyLookup | None:
    """The unrevoked key with this plaintext, with its session's state; None if there is none. A key
    stored before keyed hashing is found too, and rehashed (storage/keys.py `find_key`)."""
    found = await find_key(session_factory, hasher, key)
    if found is None:
        return None
    if found.scope == KeyScope.ADMIN.value:
        return KeyLookup(Principal("admin", None, key_id=found.id, limits=found.limits), session_active=True)
    if found.scope == KeyScope.ONLINE.value:
        principal = Principal("online", None, found.key_hash, key_id=found.id, limits=found.limits)
        return KeyLookup(principal, session_active=True)
    active = found.session_status == SessionStatus.ACTIVE.value
    principal = Principal("session", found.session_id, key_id=found.id, limits=found.limits)
    return KeyLookup(principal, session_active=active)


def bearer_key(request: Request) -> str:
    """The key of `Authorization: Bearer <key>`, else of `x-api-key: <key>` (how Anthropic's clients send
    it); 401 if neither is there or the Authorization header is malformed."""
    header = request.headers.get("authorization", "")
    if not header:
        api_key = request.headers.get("x-api-key", "").strip()
        if api_key:
            return api_key
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise _unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'."
            if not header
            else "Malformed Authorization header: expected 'Bearer <key>'."
        )
    return key


async def require_key(request: Request) -> Principal:
    """The caller of an RL control route: any valid key, including that of an ended session."""
    lookup = await _lookup(request)
    return lookup.principal


async def require_principal(request: Request) -> Principal:
    """The caller of an OpenAI route: a valid admin key, or the key of a session still active."""
    lookup = await _lookup(request)
    if not lookup.session_active:
        raise _unauthorized(
            f"Session {lookup.principal.session_id} has ended; its API key no longer works for inference."
        )
    return lookup.principal


async def require_admin(principal: Annotated[Principal, Depends(require_key)]) -> Principal:
    """The caller of an admin route; 403 for a session key."""
    if not principal.is_admin:
        raise OpenAIError(
            403, "This route needs an admin API key.", "permission_error", code="admin_required"
        )
    return principal


async def _lookup(request: Request) -> KeyLookup:
    key = bearer_key(request)
    services = request.app.state.services
    hasher: KeyHasher = services.key_hasher
    key_hash = hasher.hash(key)
    cache: KeyCache = services.key_cache
    lookup = cache.get(key_hash)
    if lookup is None:
        lookup = await lookup_key(services.session_factory, hasher, key)
        if lookup is None:
            raise _unauthorized("Incorrect API key provided.")
        cache.put(key_hash, lookup)
    return lookup


def _unauthorized(message: str) -> OpenAIError:
    return OpenAIError(
        401, message, "authentication_error", code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )
