"""Load sglang 0.5.23's own request/response schema (`sglang/api/v1/api_types.py`) by file path.

That one file imports only msgspec, so it validates payloads without sglang's heavy dependencies.
The wheel is fetched once with `pip download --no-deps` into a cache folder.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

SGLANG_VERSION = "0.5.23"
API_TYPES_MEMBER = "sglang/api/v1/api_types.py"


def default_cache_dir() -> Path:
    base = os.environ.get("FLYWHEEL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "flywheel"
    )
    return Path(base) / f"sglang-{SGLANG_VERSION}"


def fetch_api_types(cache_dir: Path) -> Path:
    """Return the path of api_types.py, downloading the sglang wheel on first use."""
    target = cache_dir / "api_types.py"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheels = list(cache_dir.glob("sglang-*.whl"))
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"sglang=={SGLANG_VERSION}",
             "-d", str(cache_dir)],
            check=True, capture_output=True, text=True, timeout=600,
        )
        wheels = list(cache_dir.glob("sglang-*.whl"))
    with zipfile.ZipFile(wheels[0]) as wheel:
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(wheel.read(API_TYPES_MEMBER))
        tmp.replace(target)
    return target


def load_api_types(cache_dir: Path | None = None) -> ModuleType:
    """Import sglang's api_types.py as a standalone module named `sglang_api_types`."""
    path = fetch_api_types(cache_dir or default_cache_dir())
    spec = importlib.util.spec_from_file_location("sglang_api_types", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
