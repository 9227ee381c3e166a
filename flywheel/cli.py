"""The `flywheel` command line: `flywheel [-c config.yaml] COMMAND [key.sub=value ...]`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from flywheel.config import ONLINE_OVERRIDES, ConfigError, FlywheelConfig, load_config
from flywheel.export import add_export_parser, run_export
from flywheel.openclaw_cli import add_openclaw_parser, run_openclaw
from flywheel.ops_cli import add_ops_parsers, run_sessions, run_status
from rewards.hooks.adapters import HookConfigError
from storage.config import StorageSetupError

if TYPE_CHECKING:
    from storage.keys import KeyInfo, KeyLimits

log = logging.getLogger("flywheel")

REVOKE_HELP = (
    "revoke the key with this id (from `keys list`): every proxy on the database refuses it within "
    "proxy.key_cache_ttl_s (a proxy keeps a key it checked that long; one revoked through "
    "POST /rl/v1/keys/{id}/revoke is refused at once by the proxy that revoked it); a call already "
    "running finishes. The last unrevoked admin key cannot be revoked: create another first"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flywheel",
        description="Turn black-box LLM agents into RL training.",
        epilog="Config precedence: the YAML file, then FLYWHEEL_* env (nested with __), then key.sub=value.",
    )
    parser.add_argument(
        "-c", "--config", default=os.environ.get("FLYWHEEL_CONFIG"), help="YAML file ($FLYWHEEL_CONFIG)"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help_text, description=help_text)

    engine = command("engine", "run one serving worker: the CPU engine, or an SGLang server on GPU")
    engine.add_argument("--worker-index", type=int, default=0, help="listen on serving.port + this")
    command("proxy", "run the OpenAI-compatible proxy and the RL control API")
    command("trainer", "run the Ray trainer: claim rewarded trajectories, train, push weights")
    up = command("up", "run engine(s), proxy and trainer on this machine until Ctrl-C")
    up.add_argument("--online", action="store_true",
                    help="online training on live traffic: every new version is evaluated on online.eval "
                         "before it is served (an eval engine is started), ungrouped samples use running "
                         "baselines, and an online key is written to <run dir>/online_key")
    rewards = command("rewards", "reward hooks: run their jobs in this process, or list them")
    reward_actions = rewards.add_subparsers(dest="action", required=True, metavar="ACTION")
    run_hooks = reward_actions.add_parser(
        "run", help="claim and run reward hook jobs until Ctrl-C (set rewards.runner.in_proxy=false)",
        description="claim and run reward hook jobs until Ctrl-C; several may share one database",
    )
    run_hooks.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics here")
    run_hooks.add_argument("--metrics-host", default="127.0.0.1",
                           help="interface of the metrics port (0.0.0.0 for a Prometheus elsewhere)")
    reward_actions.add_parser("hooks", help="list the built-in reward hooks",
                              description="the built-in reward hooks")
    keys = command("keys", "API keys: create, list, revoke")
    key_actions = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = key_actions.add_parser("create", help="a new key, printed once", description="a new key")
    kind = create.add_mutually_exclusive_group(required=True)
    kind.add_argument("--admin", action="store_true", help="an admin key (shown once)")
    kind.add_argument("--online", action="store_true",
                      help="an online key (shown once): its calls are grouped into sessions by conversation")
    create.add_argument("--requests-per-s", type=float, default=None,
                        help="this key's own rate limit (else its kind's: proxy.rate_limits)")
    create.add_argument("--burst", type=_positive_int, default=None,
                        help="calls allowed at once above that rate (default: the rate, rounded up)")
    create.add_argument("--tokens-per-day", type=_positive_int, default=None,
                        help="this key's own daily quota of prompt + completion tokens (UTC days)")
    listing = key_actions.add_parser("list", help="stored keys, newest first: id, kind, created, revoked, "
                                     "session (never a key or its hash)", description="stored keys")
    listing.add_argument("--kind", choices=["admin", "online", "session"], help="only keys of this kind")
    listing.add_argument("--limit", type=_positive_int, default=100, help="show at most this many (100)")
    revoke = key_actions.add_parser("revoke", help=REVOKE_HELP, description=REVOKE_HELP)
    revoke.add_argument("key_id", type=int, metavar="ID")
    command("demo", "run the whole loop on a math agent and report what it learned")
    db = command("db", "database schema (Alembic); purge-json: purge raw JSON past retention once")
    db.add_argument("action", choices=["upgrade", "downgrade", "current", "purge-json"])
    db.add_argument("--revision", default=None, help="target revision (upgrade: head; downgrade: -1)")
    db.add_argument("--older-than", type=float, default=None, metavar="SECONDS",
                    help="purge-json: the retention (default: proxy.privacy.raw_json_retention_s)")
    command("config", "print the resolved config as YAML")
    openclaw = command("openclaw", "OpenClaw: point its config at this proxy")
    openclaw_actions = add_openclaw_parser(openclaw)
    session_actions = add_ops_parsers(command)  # status, sessions list|show
    add_export_parser(command)
    nested = [*key_actions.choices.values(), *openclaw_actions, *session_actions]
    for sub in [*commands.choices.values(), *nested]:
        if sub not in (keys, openclaw, commands.choices["sessions"]):  # `keys ACTION`: after the action
            sub.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come before or after options (`db downgrade --revision base storage.url=...`).
    args, extra = parser.parse_known_args(argv)
    unknown = [item for item in extra if item.startswith("-") or "=" not in item]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]
    if getattr(args, "online", False) and args.command == "up":
        args.overrides = [*ONLINE_OVERRIDES, *args.overrides]
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"flywheel: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.run.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if config.run.log_level != "DEBUG":  # alembic logs its plugin set-up at INFO on import
        logging.getLogger("alembic").setLevel(logging.WARNING)
    handler = _HANDLERS[args.command]
    try:
        return handler(config, args)
    except StorageSetupError as exc:  # the database cannot be used as configured: say what to do
        print(f"flywheel: {exc}", file=sys.stderr)
        return 1
    except HookConfigError as exc:  # a configured reward hook cannot be used
        print(f"flywheel: {exc}", file=sys.stderr)
        return 2


def _run_engine(config: FlywheelConfig, args: argparse.Namespace) -> int:
    serving = config.serving
    port = serving.port + args.worker_index
    if serving.backend == "sglang":
        import asyncio

        from flywheel.sglang_worker import serve_sglang

        (config.run.dir / "logs").mkdir(parents=True, exist_ok=True)
        return asyncio.run(serve_sglang(serving, port, config.run.dir / "logs"))
    from serving.engine.server import run_engine

    run_engine(serving, serving.host, port, worker_index=args.worker_index)
    return 0


def _check_storage(config: FlywheelConfig) -> None:
    """Before a command uses the database: migrate the embedded SQLite default, refuse any other
    database behind this Flywheel's schema (storage/migrate.py `ensure_schema`)."""
    from storage.migrate import ensure_schema

    ensure_schema(config.storage, upgrade_sqlite=True)


def _run_proxy(config: FlywheelConfig, args: argparse.Namespace) -> int:
    from storage.keys import load_key_hasher

    _check_storage(config)
    load_key_hasher(config.storage)  # a missing key secret, said here rather than in a startup traceback
    from proxy.server import run_proxy
    from proxy.services import check_hooks
    from rewards.hooks.registry import HookRegistry

    check_hooks(HookRegistry.built_in(), config.rewards)  # likewise a configured hook that cannot be used

    run_proxy(config.proxy, config.storage, config.serving, config.rewards)
    return 0


def _run_trainer(config: FlywheelConfig, args: argparse.Namespace) -> int:
    _check_storage(config)
    from trainer.runner import run_trainer

    gate = None
    if config.trainer.promotion.enabled:
        from functools import partial

        from rewards.evaluation import open_evaluator
        from serving.models.loading import default_cache_dir, resolve_model_dir

        serving = config.serving
        model_dir = resolve_model_dir(serving.model, serving.cache_dir or default_cache_dir())
        gate = partial(open_evaluator, config.online.eval, model_dir, serving.client)
    run_trainer(
        config.trainer, config.storage, config.serving, config.serving.resolved_worker_urls(),
        run_dir=config.run.dir, gate=gate,
    )
    return 0


def _exit_on_sigterm() -> None:
    """Make SIGTERM run the same clean-up as Ctrl-C (stop the child processes), not kill us bare."""
    import signal

    def exit_now(signum: int, _frame: object) -> None:
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, exit_now)


def _run_up(config: FlywheelConfig, args: argparse.Namespace) -> int:
    import asyncio

    _exit_on_sigterm()

    from flywheel.progress import PhaseBar, progress_bar
    from flywheel.stack import describe, run_until_stopped, start_stack, startup_phases

    async def up() -> int:
        with progress_bar(startup_phases(config), desc="start-up", unit="phase") as bar:
            phases = PhaseBar(bar)
            stack = await start_stack(
                config, args.config, args.overrides, online=args.online, on_phase=phases
            )
            phases.finish()
        print(describe(stack, config.run.dir), flush=True)
        return await run_until_stopped(stack)

    try:
        return asyncio.run(up())
    except KeyboardInterrupt:
        return 130


def _new_key(config: FlywheelConfig, online: bool, limits: KeyLimits | None = None) -> str:
    """A new admin or online key stored in the configured database (migrated first where it may be);
    its plaintext, shown once."""
    import asyncio

    from proxy.auth import create_admin_key, create_online_key
    from storage.engine import create_engine, create_sessionmaker
    from storage.keys import NO_KEY_LIMITS, load_key_hasher

    _check_storage(config)
    hasher = load_key_hasher(config.storage)

    async def create() -> str:
        engine = create_engine(config.storage)
        try:
            make = create_online_key if online else create_admin_key
            return await make(create_sessionmaker(engine), hasher, limits or NO_KEY_LIMITS)
        finally:
            await engine.dispose()

    return asyncio.run(create())


def _run_keys(config: FlywheelConfig, args: argparse.Namespace) -> int:
    import asyncio

    from storage.engine import create_engine, create_sessionmaker
    from storage.keys import KeyLimits, LastAdminKeyError, list_keys, revoke_key

    if args.action == "create":
        print(_new_key(config, args.online, KeyLimits(args.requests_per_s, args.burst, args.tokens_per_day)))
        return 0
    _check_storage(config)

    async def run() -> int:
        engine = create_engine(config.storage)
        try:
            session_factory = create_sessionmaker(engine)
            if args.action == "list":
                keys = await list_keys(session_factory, scope=args.kind, limit=args.limit + 1)
                print(_key_table(keys[:args.limit]))
                if len(keys) > args.limit:
                    print(f"(the newest {args.limit} shown; --limit N shows more)", file=sys.stderr)
            else:
                try:
                    info = await revoke_key(session_factory, args.key_id)
                except LookupError:
                    print(f"flywheel: no API key {args.key_id}", file=sys.stderr)
                    return 1
                except LastAdminKeyError as exc:
                    print(f"flywheel: {exc}", file=sys.stderr)
                    return 1
                print(f"key {info.id} ({info.scope}) revoked at {info.revoked_at:%Y-%m-%d %H:%M:%S}")
            return 0
        finally:
            await engine.dispose()

    return asyncio.run(run())


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _key_table(keys: Sequence[KeyInfo]) -> str:
    """The keys as a plain table: id, kind, created, revoked, session (no key, no hash)."""
    rows = [("ID", "KIND", "CREATED (UTC)", "REVOKED (UTC)", "SESSION")]
    for key in keys:
        rows.append((
            str(key.id), key.scope, f"{key.created_at:%Y-%m-%d %H:%M:%S}",
            "-" if key.revoked_at is None else f"{key.revoked_at:%Y-%m-%d %H:%M:%S}", key.session_id or "-",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def _run_rewards(config: FlywheelConfig, args: argparse.Namespace) -> int:
    import asyncio

    from flywheel.rewards_cli import list_hooks, run_hooks

    if args.action == "hooks":
        print(list_hooks())
        return 0
    _check_storage(config)
    return asyncio.run(run_hooks(config, args.metrics_port, args.metrics_host))


def _run_demo(config: FlywheelConfig, args: argparse.Namespace) -> int:
    from flywheel.demo import run_demo

    _exit_on_sigterm()
    return run_demo(args.config, args.overrides)


def _run_db(config: FlywheelConfig, args: argparse.Namespace) -> int:
    from storage import migrate

    if args.action == "purge-json":
        from flywheel.purge_json import purge_json

        _check_storage(config)
        return purge_json(config, args.older_than)
    url = config.storage.url
    if args.action == "upgrade":
        migrate.upgrade(url, args.revision or "head")
    elif args.action == "downgrade":
        migrate.downgrade(url, args.revision or "-1")
    print(f"{_redact(url)}: at revision {migrate.current(url)}")
    return 0


def _run_openclaw(config: FlywheelConfig, args: argparse.Namespace) -> int:
    return run_openclaw(config, args, lambda: _new_key(config, online=True))


def _print_config(config: FlywheelConfig, args: argparse.Namespace) -> int:
    import yaml

    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


_HANDLERS = {
    "engine": _run_engine,
    "proxy": _run_proxy,
    "trainer": _run_trainer,
    "up": _run_up,
    "keys": _run_keys,
    "rewards": _run_rewards,
    "demo": _run_demo,
    "db": _run_db,
    "config": _print_config,
    "openclaw": _run_openclaw,
    "status": run_status,
    "sessions": run_sessions,
    "export": run_export,
}


if __name__ == "__main__":
    sys.exit(main())
