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
    command("demo", "start an engine with the demo model and ask it one chat question")
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


def _run_demo(config: FlywheelConfig, args: argparse.Namespace) -> int:
    import asyncio

    from flywheel.demo import run_demo

    answer = asyncio.run(run_demo(config, args.config, args.overrides))
    print(answer)
    return 0


def _run_db(config: FlywheelConfig, args: argparse.Namespace) -> int:
    if config.run.log_level != "DEBUG":  # before alembic's import, which logs its plugins
        logging.getLogger("alembic").setLevel(logging.WARNING)
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


_HANDLERS = {"engine": _run_engine, "demo": _run_demo, "db": _run_db, "config": _print_config}


if __name__ == "__main__":
    sys.exit(main())
