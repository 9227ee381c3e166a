"""Entry point of `python -m integrations.gsm8k` (see integrations/gsm8k/cli.py)."""

from integrations.gsm8k.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
