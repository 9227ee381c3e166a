"""Entry point of `python -m integrations.scaffoldings` (see integrations/scaffoldings/cli.py)."""

from integrations.scaffoldings.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
