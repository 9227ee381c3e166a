"""Entry point of `python -m integrations.openclaw` (see integrations/openclaw/cli.py)."""

from integrations.openclaw.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
