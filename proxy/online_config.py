"""How an online key's calls are grouped into sessions (`proxy.online`; proxy/conversations/online.py,
docs/online.md)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class OnlineConfig(BaseModel):
    """Grouping an online key's live traffic into sessions."""

    model_config = ConfigDict(extra="forbid")

    end_on_new_conversation: bool = True
    """When an online key's call without a conversation hint starts a new session, end the key's older
    active sessions that have no hint either, as `POST /rl/v1/sessions/{id}/end` does (their reward hooks
    are queued, the finalizer takes over once their calls in flight are recorded). An agent that holds
    one conversation at a time then has each conversation trained soon after the next one begins, not
    `proxy.finalizer.session_ttl_s` after its last call. Turn it off when one online key carries several
    conversations at once without hints: each new one would end the others. Sessions with a hint
    (`X-Flywheel-Conversation`) end only when asked to or by that TTL."""
