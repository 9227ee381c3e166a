"""Proxy overhead, quick: superseded by benchmarks/proxy_overhead.py (every stack, 1/16/64 clients,
streaming and not); this entry point runs its `--quick` mode on the worker and Flywheel on SQLite.

    .venv/bin/python benchmarks/proxy_overhead_quick.py [more proxy_overhead.py options]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.proxy_overhead import main

if __name__ == "__main__":
    main(["--quick", "--only", "worker,flywheel-sqlite", *sys.argv[1:]])
