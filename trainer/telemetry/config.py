"""The trainer's experiment-tracking settings: `trainer.wandb` and `trainer.mlflow` (each None = off)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WandbConfig(_Strict):
    """A Weights & Biases run per trainer process (needs `pip install 'flywheel-rl[tracking]'`). Log in
    with `wandb login` or `WANDB_API_KEY` for `mode: online`."""

    project: str = Field(min_length=1)
    """The W&B project."""
    entity: str | None = None
    """The team or user owning the project; None: the logged-in user's default."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """`offline` writes the run under `dir` only (`wandb sync` uploads it later); `disabled` logs nothing."""
    name: str | None = None
    """The run's display name; None: W&B's generated one."""
    group: str | None = None
    """Groups runs in the UI (e.g. one experiment's restarts)."""
    tags: tuple[str, ...] = ()
    run_id: str | None = None
    """Resume this run id (created if missing), so that a restarted trainer goes on logging into the same
    run; None starts a new run each time."""
    dir: Path | None = None
    """Where W&B keeps its files (`<dir>/wandb/`); None: the run directory."""


class MlflowConfig(_Strict):
    """An MLflow run per trainer process (needs `pip install 'flywheel-rl[tracking]'`)."""

    tracking_uri: str | None = None
    """`http://host:5000`, `sqlite:///mlflow.db`, `databricks`, ...; None: MLflow's own default
    (`MLFLOW_TRACKING_URI`, else a local store)."""
    experiment: str = Field("flywheel", min_length=1)
    """The experiment the run goes into, created if missing."""
    run_name: str | None = None
    """The run's name; None: MLflow's generated one."""
    tags: dict[str, str] = Field(default_factory=dict)
    """Tags set on the run."""
