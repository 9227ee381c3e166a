"""Session finalizer sub-config: how rewards become trajectory rewards, and when sessions are finalized."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class FinalizerConfig(BaseModel):
    """How the session finalizer turns a session's completions and rewards into trajectories."""

    model_config = ConfigDict(extra="forbid")

    style: Literal["concatenated", "individual"] = "concatenated"
    """"concatenated": one trajectory per conversation chain (root → leaf), its outputs trained and the
    prompt suffixes between them (tool results, user turns) masked (rewards/concatenate.py).
    "individual": one trajectory per trainable completion (its full prompt masked, its output
    trained)."""
    turn_discount: float = Field(1.0, ge=0.0, le=1.0)
    """"individual" style only: γ of `R_i = r_i + γ·R_{i+1}`, walking back over a session's trainable
    completions in call order. 1.0 gives every turn the whole session's reward; 0.0 keeps each turn's
    own reward."""
    missing_reward: Literal["zero", "drop"] = "zero"
    """A session finalized with no reward at all: "zero" trains on it with reward 0 (AReaL's behaviour),
    "drop" writes no trajectories for it. Either way a warning is logged. A session's own metadata key
    "missing_reward" overrides this (the proxy's one-off admin-call sessions say "drop")."""
    reward_grace_s: float = Field(60.0, ge=0.0)
    """How long an ended session without any reward waits for one before the sweep finalizes it under
    `missing_reward` (a driver may end a session first and post its reward afterwards)."""
    session_ttl_s: float = Field(3600.0, gt=0.0)
    """A session still active this long after it was created is ended and finalized by the sweep; an
    online key's session (proxy/conversations/online.py) this long after its last call."""
    sweep_interval_s: float = Field(5.0, gt=0.0)
    """Seconds between background sweeps for ended, expired or missed sessions."""
    call_drain_timeout_s: float = Field(900.0, gt=0.0)
    """Longest a session's finalization waits for its calls still generating or recording in the proxy
    (longer than `proxy.resume_timeout_s`, the longest a generation waits out weight pushes); a call
    still running after that is not in the session's trajectories, and a warning says so."""
