"""`flywheel status` and `flywheel sessions list|show`: what a run holds and where it stands, read from
its database (storage/ops_queries.py), as aligned plain-text tables or, with `--json`, one JSON document
for scripts. Read-only: nothing here writes a row.

`status` shows the policy versions (newest trained, served, best with its eval score), the trainer's
steps, what waits (open sessions, ended ones awaiting their reward, unconsumed trajectories, reward hook
jobs by state), totals, and with `--proxy URL` what that proxy answers. `sessions list` lists sessions
newest first; `sessions show ID` one session's completion tree (flywheel/session_view.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flywheel.cli_support import (
    MOMENT_HELP,
    at_text,
    check_database,
    format_table,
    iso,
    opened,
    parse_moment,
    positive_int,
)
from flywheel.config import FlywheelConfig
from flywheel.session_view import gather_session, gather_sessions, session_list_text, session_text
from storage.config import StorageConfig
from storage.engine import SessionFactory
from storage.models import JobState, SessionStatus, VersionStatus
from storage.ops_queries import SessionFilter

SESSION_STATES = tuple(state.value for state in SessionStatus)
JOB_STATES = tuple(state.value for state in JobState)
VERSION_STATES = tuple(state.value for state in VersionStatus)

Command = Callable[[str, str], argparse.ArgumentParser]


def add_ops_parsers(command: Command) -> list[argparse.ArgumentParser]:
    """Add `status` and `sessions list|show` through `command(name, help)`; returns the `sessions`
    actions (the config overrides follow them)."""
    status = command("status", "where the run stands: policy versions, trainer steps, queues, totals")
    status.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    status.add_argument("--proxy", metavar="URL", default=None,
                        help="also ask this proxy (its /health; its served model with a key)")
    status.add_argument("--proxy-key", default=None,
                        help="the key for --proxy's /v1/models (default: <run dir>/admin_key, if any)")
    sessions = command("sessions", "sessions: list them, or show one's completion tree")
    actions = sessions.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="sessions, newest first", description="sessions, newest first")
    listing.add_argument("--state", choices=SESSION_STATES, default=None, help="only sessions in this state")
    listing.add_argument("--run", default=None, help="only sessions whose metadata has this `run` label")
    listing.add_argument("--since", type=parse_moment, default=None, metavar="TIME",
                         help=f"only sessions created since TIME: {MOMENT_HELP}")
    listing.add_argument("--limit", type=positive_int, default=50, help="show at most this many (50)")
    listing.add_argument("--json", action="store_true", help="a JSON list instead of the table")
    show = actions.add_parser("show", help="one session: its completion tree, rewards, hook jobs, samples",
                              description="one session: its completion tree, rewards, hook jobs, samples")
    show.add_argument("session_id", metavar="ID")
    show.add_argument("--json", action="store_true", help="one JSON document instead of the text")
    return [listing, show]


def run_status(config: FlywheelConfig, args: argparse.Namespace) -> int:
    """`flywheel status`: print the run's state."""
    check_database(config.storage)
    report = asyncio.run(gather_status(config.storage))
    if args.proxy:
        report["proxy"] = probe_proxy(args.proxy, args.proxy_key or _run_admin_key(config.run.dir))
    print(json.dumps(report, indent=2) if args.json else status_text(report))
    return 0


async def gather_status(storage: StorageConfig) -> dict[str, Any]:
    """The status document (what `--json` prints)."""
    from storage.ops_queries import backlog, train_progress
    from storage.policy_versions import best_version, newest_version, served_version

    async with opened(storage) as session_factory:
        counts = await backlog(session_factory)
        progress = await train_progress(session_factory)
        newest, served, best = (await newest_version(session_factory), await served_version(session_factory),
                                await best_version(session_factory))
    sessions = {state: counts.sessions.get(state, 0) for state in SESSION_STATES}
    return {
        "policy": {
            "newest": None if newest is None else newest.as_json(),
            "served": None if served is None else served.as_json(),
            "best": None if best is None else best.as_json(),
            "versions": {state: counts.policy_versions.get(state, 0) for state in VERSION_STATES},
        },
        "trainer": {
            "steps": progress.steps, "last_step": progress.last_step,
            "last_step_version": progress.last_step_version, "last_step_at": iso(progress.last_step_at),
            "last_metrics": progress.last_metrics,
        },
        "queues": {
            "sessions_active": sessions["active"],
            "sessions_ended": sessions["ended"],
            "trajectories_unconsumed": counts.unconsumed,
            "trajectories_claimed": counts.claimed,
            "reward_jobs": {state: counts.reward_jobs.get(state, 0) for state in JOB_STATES},
        },
        "totals": {
            "sessions": sum(sessions.values()), "sessions_finalized": sessions["finalized"],
            "groups": counts.groups, "completions": counts.completions,
            "last_completion_at": iso(counts.last_completion_at), "trajectories": counts.trajectories,
            "trajectories_consumed": counts.trajectories - counts.unconsumed - counts.dropped,
            "trajectories_dropped": counts.dropped,
        },
    }


def status_text(report: dict[str, Any]) -> str:
    """The status document as aligned `section  item  value` lines."""
    policy, trainer, queues, totals = report["policy"], report["trainer"], report["queues"], report["totals"]
    versions = policy["versions"]
    last_step = "-" if trainer["last_step"] is None else (
        f"step {trainer['last_step']} → v{trainer['last_step_version']} at {at_text(trainer['last_step_at'])}"
    )
    jobs = queues["reward_jobs"]
    rows = [
        ("SECTION", "WHAT", "VALUE"),
        ("policy", "newest trained", _version_text(policy["newest"])),
        ("", "served", _version_text(policy["served"], served=True)),
        ("", "best", _version_text(policy["best"])),
        ("", "versions", ", ".join(f"{versions[state]} {state}" for state in VERSION_STATES)),
        ("trainer", "steps", str(trainer["steps"])),
        ("", "last step", last_step),
        ("queues", "sessions open", str(queues["sessions_active"])),
        ("", "ended, awaiting reward", str(queues["sessions_ended"])),
        ("", "unconsumed trajectories", f"{queues['trajectories_unconsumed']} "
                                        f"({queues['trajectories_claimed']} claimed)"),
        ("", "reward hook jobs", ", ".join(f"{jobs[state]} {state}" for state in JOB_STATES)),
        ("totals", "sessions", f"{totals['sessions']} ({totals['sessions_finalized']} finalized)"),
        ("", "groups", str(totals["groups"])),
        ("", "completions", f"{totals['completions']} (last at {at_text(totals['last_completion_at'])})"),
        ("", "trajectories", f"{totals['trajectories']} ({totals['trajectories_consumed']} consumed, "
                             f"{totals['trajectories_dropped']} dropped as stale)"),
    ]
    proxy = report.get("proxy")
    if proxy is not None:
        health = "ok" if proxy["healthy"] else f"down: {proxy['error']}"
        rows += [("proxy", "url", proxy["url"]), ("", "health", health)]
        if proxy.get("model") is not None:
            rows.append(("", "served model", f"{proxy['model']} ({proxy['max_model_len']} tokens)"))
        if proxy.get("policy_version") is not None:
            rows.append(("", "policy version", str(proxy["policy_version"])))
    return format_table(rows)


def _version_text(info: dict[str, Any] | None, served: bool = False) -> str:
    if info is None:
        return "-"
    text = f"v{info['version']} {info['status']}"
    if info["eval_score"] is not None:
        text += f", eval {info['eval_score']:.4g}"
    if served:
        text += f", served since {at_text(info['served_at'])}"
    return text


def _run_admin_key(run_dir: Path) -> str | None:
    """The admin key `flywheel up` wrote into the run directory, if there is one."""
    from flywheel.stack import ADMIN_KEY_FILE

    path = run_dir / ADMIN_KEY_FILE
    if not path.is_file():
        return None
    return path.read_text().strip() or None


def probe_proxy(url: str, key: str | None, timeout_s: float = 5.0) -> dict[str, Any]:
    """What a proxy answers: its health, and with a key its served model and policy version. A proxy that
    does not answer is reported down, not an error."""
    import httpx

    found: dict[str, Any] = {"url": url, "healthy": False, "error": None, "model": None,
                             "max_model_len": None, "policy_version": None}
    base = url.rstrip("/")
    try:
        with httpx.Client(timeout=timeout_s) as client:
            health = client.get(f"{base}/health")
            found["healthy"] = health.status_code == 200
            if not found["healthy"]:
                found["error"] = f"/health answered {health.status_code}"
            if key and found["healthy"]:
                headers = {"Authorization": f"Bearer {key}"}
                models = client.get(f"{base}/v1/models", headers=headers)
                if models.status_code == 200 and models.json().get("data"):
                    entry = models.json()["data"][0]
                    found.update(model=entry.get("id"), max_model_len=entry.get("max_model_len"))
                policy = client.get(f"{base}/rl/v1/policy", headers=headers)
                if policy.status_code == 200:
                    found["policy_version"] = policy.json().get("policy_version")
    except httpx.HTTPError as exc:
        found["error"] = f"{type(exc).__name__}: {exc}"
    return found


def run_sessions(config: FlywheelConfig, args: argparse.Namespace) -> int:
    """`flywheel sessions list|show`."""
    check_database(config.storage)
    rule = config.proxy.finalizer.rest_and_hooks
    if args.action == "list":
        filt = SessionFilter(status=args.state, run=args.run, since=args.since, limit=args.limit)
        listed = asyncio.run(_with_database(config.storage, lambda sf: gather_sessions(sf, filt, rule)))
        print(json.dumps(listed, indent=2) if args.json else session_list_text(listed))
        return 0
    shown = asyncio.run(_with_database(config.storage, lambda sf: gather_session(sf, args.session_id, rule)))
    if shown is None:
        print(f"flywheel: no session {args.session_id!r}", file=sys.stderr)
        return 1
    print(json.dumps(shown, indent=2) if args.json else session_text(shown))
    return 0


async def _with_database(storage: StorageConfig, read: Callable[[SessionFactory], Any]) -> Any:
    async with opened(storage) as session_factory:
        return await read(session_factory)
