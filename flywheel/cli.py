"""The `flywheel` command line: `flywheel [-c config.yaml] COMMAND [key.sub=value ...]`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from flywheel.config import ConfigError, FlywheelConfig, load_config

log = logging.getLogger("flywheel")


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
    command("up", "run engine(s), proxy and trainer on this machine until Ctrl-C")
    keys = command("keys", "API keys")
    keys.add_argument("action", choices=["create"])
    kind = keys.add_mutually_exclusive_group(required=True)
    kind.add_argument("--admin", action="store_true", help="an admin key (shown once)")
    kind.add_argument("--online", action="store_true",
                      help="an online key (shown once): its calls are grouped into sessions by conversation")
    command("demo", "run the whole loop on a math agent and report what it learned")
    db = command("db", "database schema (Alembic)")
    db.add_argument("action", choices=["upgrade", "downgrade", "current"])
    db.add_argument("--revision", default=None, help="target revision (upgrade: head; downgrade: -1)")
    command("config", "print the resolved config as YAML")
    for sub in commands.choices.values():
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
    return handler(config, args)


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


def _run_proxy(config: FlywheelConfig, args: argparse.Namespace) -> int:
    from proxy.server import run_proxy

    run_proxy(config.proxy, config.storage, config.serving)
    return 0


def _run_trainer(config: FlywheelConfig, args: argparse.Namespace) -> int:
    from trainer.runner import run_trainer

    run_trainer(
        config.trainer, config.storage, config.serving, config.serving.resolved_worker_urls(),
        run_dir=config.run.dir,
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

    from flywheel.stack import describe, run_until_stopped, start_stack

    async def up() -> int:
        stack = await start_stack(config, args.config, args.overrides)
        print(describe(stack, config.run.dir), flush=True)
        return await run_until_stopped(stack)

    try:
        return asyncio.run(up())
    except KeyboardInterrupt:
        return 130


def _run_keys(config: FlywheelConfig, args: argparse.Namespace) -> int:
    import asyncio

    from proxy.auth import create_admin_key, create_online_key
    from storage.engine import create_engine, create_sessionmaker

    async def create() -> str:
        engine = create_engine(config.storage)
        try:
            if args.online:
                return await create_online_key(create_sessionmaker(engine))
            return await create_admin_key(create_sessionmaker(engine))
        finally:
            await engine.dispose()

    print(asyncio.run(create()))
    return 0


def _run_demo(config: FlywheelConfig, args: argparse.Namespace) -> int:
    from flywheel.demo import run_demo

    _exit_on_sigterm()
    return run_demo(args.config, args.overrides)


def _run_db(config: FlywheelConfig, args: argparse.Namespace) -> int:
    from storage import migrate

    url = config.storage.url
    if args.action == "upgrade":
        migrate.upgrade(url, args.revision or "head")
    elif args.action == "downgrade":
        migrate.downgrade(url, args.revision or "-1")
    print(f"{_redact(url)}: at revision {migrate.current(url)}")
    return 0


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
    "demo": _run_demo,
    "db": _run_db,
    "config": _print_config,
}


if __name__ == "__main__":
    sys.exit(main())
