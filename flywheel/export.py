"""`flywheel export`: trajectories out of the database as a dataset that Hugging Face `datasets` loads,
one row per trajectory, JSON lines or Parquet.

Layout: `DIR/data/train-00000-of-0000N.{jsonl,parquet}`, a new shard every `--shard-rows` rows, and a
dataset card `DIR/README.md` whose YAML header declares the split and the column types, so that
`load_dataset(DIR)`, `load_dataset("json", data_files="DIR/data/*.jsonl")` and
`load_dataset("parquet", data_files="DIR/data/*.parquet")` all read it. Rows are read in id order a batch
at a time (storage/export_queries.py) and written as they come; shards are written under hidden names and
renamed once the count is known, so a failed export leaves no shard a loader would pick up (and, with
`--overwrite`, the earlier export's shards are removed only then).

Columns: `token_ids`, `loss_mask`, `logprobs` (float32, bit-exact in Parquet; in JSON the same value
written as a double, which reads back as the same float32, a non-finite one as null), `versions` (per
token, -1 where not generated), `reward`, `temperature`, `min_version` and `max_version` (of the
generated tokens), `consumed_step` (null: not trained on yet), `trajectory_id`, `session_id`,
`group_id`, `completion_ids`, `task` and `metadata` (the session's, as JSON text: their shapes vary from
task to task), `created_at` (ISO 8601, UTC).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec
import numpy as np

from flywheel.cli_support import MOMENT_HELP, check_database, opened, parse_moment, positive_int
from flywheel.config import FlywheelConfig
from storage.engine import SessionFactory
from storage.export_queries import (
    ExportRow,
    TrajectoryFilter,
    candidate_batches,
    count_candidates,
    keep,
    newest_trajectory_id,
)

Format = Literal["jsonl", "parquet"]
SPLIT = "train"
CARD = "README.md"

# (name, datasets feature as the card's YAML writes it) in column order.
COLUMNS: tuple[tuple[str, dict[str, str]], ...] = (
    ("trajectory_id", {"dtype": "int64"}),
    ("session_id", {"dtype": "string"}),
    ("group_id", {"dtype": "string"}),
    ("token_ids", {"list": "int32"}),
    ("loss_mask", {"list": "bool"}),
    ("logprobs", {"list": "float32"}),
    ("versions", {"list": "int32"}),
    ("reward", {"dtype": "float64"}),
    ("temperature", {"dtype": "float64"}),
    ("min_version", {"dtype": "int64"}),
    ("max_version", {"dtype": "int64"}),
    ("consumed_step", {"dtype": "int64"}),
    ("completion_ids", {"list": "string"}),
    ("task", {"dtype": "string"}),
    ("metadata", {"dtype": "string"}),
    ("created_at", {"dtype": "string"}),
)
COLUMN_NAMES = tuple(name for name, _ in COLUMNS)


def add_export_parser(command: Callable[[str, str], argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add `export` through `command(name, help)`."""
    export = command("export", "write trajectories as a Hugging Face dataset (JSON lines or Parquet)")
    export.add_argument("--out", type=Path, required=True, metavar="DIR",
                        help="the dataset folder: DIR/data/train-*.{jsonl,parquet} and DIR/README.md")
    export.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl", help="(default: jsonl)")
    export.add_argument("--run", default=None, help="only sessions whose metadata has this `run` label")
    export.add_argument("--min-version", type=int, default=None,
                        help="only rows whose generated tokens all come from this policy version or later")
    export.add_argument("--max-version", type=int, default=None,
                        help="only rows whose generated tokens all come from this policy version or earlier")
    export.add_argument("--min-reward", type=float, default=None, help="only rows rewarded at least this")
    export.add_argument("--since", type=parse_moment, default=None, metavar="TIME",
                        help=f"only rows created since TIME: {MOMENT_HELP}")
    export.add_argument("--until", type=parse_moment, default=None, metavar="TIME",
                        help="only rows created before TIME (the same forms)")
    trained = export.add_mutually_exclusive_group()
    trained.add_argument("--consumed", dest="consumed", action="store_true", default=None,
                         help="only rows a train step consumed already")
    trained.add_argument("--unconsumed", dest="consumed", action="store_false", default=None,
                         help="only rows no train step consumed yet")
    export.add_argument("--shard-rows", type=positive_int, default=50_000,
                        help="rows per shard file (default: %(default)s)")
    export.add_argument("--batch-rows", type=positive_int, default=500,
                        help="rows read from the database per query (default: %(default)s)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace the shards and card of an earlier export in DIR")
    return export


TOKEN_COLUMNS = ("token_ids", "loss_mask", "logprobs", "versions")


def row_json(row: ExportRow) -> dict[str, Any]:
    """One row as the JSON-lines shard holds it (a Parquet shard holds the same values, typed): float32
    logprobs become the doubles of the same values."""
    per_token = {name: getattr(row, name).tolist() for name in TOKEN_COLUMNS}
    return {name: per_token[name] if name in per_token else value
            for name, value in zip(COLUMN_NAMES, _row_values(row), strict=True)}


def _row_values(row: ExportRow) -> tuple[Any, ...]:
    """The row's values in column order, the per-token ones as their arrays."""
    return (
        row.trajectory_id, row.session_id, row.group_id, row.token_ids, row.loss_mask, row.logprobs,
        row.versions, row.reward, row.temperature, row.min_version, row.max_version, row.consumed_step,
        list(row.completion_ids), _json_text(row.task), _json_text(row.metadata),
        row.created_at.astimezone(UTC).isoformat(),
    )


def _json_text(value: Any) -> str | None:
    return None if value is None else msgspec.json.encode(value).decode()


class _Shard(Protocol):
    def write(self, rows: Sequence[ExportRow]) -> None: ...

    def close(self) -> None: ...


class _JsonlShard:
    def __init__(self, path: Path) -> None:
        self._file = path.open("wb")

    def write(self, rows: Sequence[ExportRow]) -> None:
        self._file.write(b"".join(msgspec.json.encode(row_json(row)) + b"\n" for row in rows))

    def close(self) -> None:
        self._file.close()


class _ParquetShard:
    def __init__(self, path: Path) -> None:
        import pyarrow.parquet as pq

        self._writer = pq.ParquetWriter(path, parquet_schema())

    def write(self, rows: Sequence[ExportRow]) -> None:
        if rows:
            self._writer.write_table(parquet_table(rows))

    def close(self) -> None:
        self._writer.close()


def parquet_schema() -> Any:
    """The Parquet shards' Arrow schema (the card's features, typed)."""
    import pyarrow as pa

    scalar = {"int64": pa.int64(), "int32": pa.int32(), "string": pa.string(), "bool": pa.bool_(),
              "float32": pa.float32(), "float64": pa.float64()}
    return pa.schema([
        (name, pa.list_(scalar[kind["list"]]) if "list" in kind else scalar[kind["dtype"]])
        for name, kind in COLUMNS
    ])


def parquet_table(rows: Sequence[ExportRow]) -> Any:
    """Rows as an Arrow table; per-token arrays go in as their numpy buffers, bit for bit."""
    import pyarrow as pa

    schema = parquet_schema()
    values = list(zip(*(_row_values(row) for row in rows), strict=True))
    columns = []
    for i, name in enumerate(COLUMN_NAMES):
        if name in TOKEN_COLUMNS:
            arrays = values[i]
            offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
            np.cumsum([len(a) for a in arrays], out=offsets[1:])
            nested = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(arrays)))
            columns.append(nested.cast(schema.field(name).type))
        else:
            columns.append(pa.array(values[i], type=schema.field(name).type))
    return pa.Table.from_arrays(columns, schema=schema)


class ShardedWriter:
    """Rows into `DIR/data` shards of at most `shard_rows` rows, named `train-iiiii-of-nnnnn` once the
    last is written (`finish`, which first removes the shards of the export they `replace`); until then
    under hidden names, which `abort` removes."""

    def __init__(self, data_dir: Path, fmt: Format, shard_rows: int, replace: Sequence[Path] = ()) -> None:
        self._dir, self._format, self._shard_rows = data_dir, fmt, shard_rows
        self._replace = list(replace)
        self._paths: list[Path] = []
        self._shard: _Shard | None = None
        self._in_shard = 0
        self.rows = 0

    def write(self, rows: Sequence[ExportRow]) -> None:
        start = 0
        while start < len(rows):
            if self._shard is None or self._in_shard == self._shard_rows:
                self._next_shard()
            assert self._shard is not None
            take = rows[start:start + self._shard_rows - self._in_shard]
            self._shard.write(take)
            self._in_shard += len(take)
            self.rows += len(take)
            start += len(take)

    def _next_shard(self) -> None:
        if self._shard is not None:
            self._shard.close()
        path = self._dir / f".partial-{len(self._paths):05d}.{self._format}"
        self._paths.append(path)
        self._shard = _JsonlShard(path) if self._format == "jsonl" else _ParquetShard(path)
        self._in_shard = 0

    def finish(self) -> list[Path]:
        """Close the last shard (an empty one when no row came) and give every shard its final name."""
        if self._shard is None:
            self._next_shard()
        assert self._shard is not None
        self._shard.close()
        for old in self._replace:
            old.unlink(missing_ok=True)
        count = len(self._paths)
        final = [self._dir / f"{SPLIT}-{i:05d}-of-{count:05d}.{self._format}" for i in range(count)]
        for partial, path in zip(self._paths, final, strict=True):
            partial.replace(path)
        return final

    def abort(self) -> None:
        if self._shard is not None:
            self._shard.close()
        for path in self._paths:
            path.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportSummary:
    """What an export wrote."""

    rows: int
    tokens: int
    shards: list[Path]


async def export_trajectories(
    session_factory: SessionFactory, filt: TrajectoryFilter, writer: ShardedWriter, batch_rows: int,
    progress: Callable[[int | None, int], None],
) -> ExportSummary:
    """Stream the rows `filt` selects, as of now, into `writer`; `progress(total, done)` is told the
    number of candidate rows (total, then None) and each batch read (done)."""
    up_to = await newest_trajectory_id(session_factory)
    progress(await count_candidates(session_factory, filt, up_to), 0)
    tokens = 0
    async for batch in candidate_batches(session_factory, filt, up_to, batch_rows):
        kept = [row for row in batch if keep(row, filt)]
        writer.write(kept)
        tokens += sum(len(row.token_ids) for row in kept)
        progress(None, len(batch))
    return ExportSummary(rows=writer.rows, tokens=tokens, shards=writer.finish())


def prepare_out(out: Path, overwrite: bool) -> tuple[Path, list[Path]]:
    """`DIR/data`, made, and the shards of an earlier export there, which are an error unless `overwrite`
    (the new export replaces them once it is written). What a killed export left is removed."""
    data = out / "data"
    earlier = sorted(data.glob(f"{SPLIT}-*")) if data.is_dir() else []
    if earlier and not overwrite:
        raise FileExistsError(f"{data} holds an earlier export ({earlier[0].name}, …): pass --overwrite "
                              "to replace it, or choose another --out")
    data.mkdir(parents=True, exist_ok=True)
    for partial in data.glob(".partial-*"):
        partial.unlink()
    return data, earlier


def dataset_card(summary: ExportSummary, fmt: Format, filters: dict[str, Any]) -> str:
    """README.md: the YAML header `datasets` reads (split files, features), then what was exported."""
    import yaml

    header = {
        "configs": [{"config_name": "default",
                     "data_files": [{"split": SPLIT, "path": f"data/{SPLIT}-*.{fmt}"}]}],
        "dataset_info": {"features": [{"name": name, **kind} for name, kind in COLUMNS]},
    }
    chosen = ", ".join(f"{key}={value}" for key, value in filters.items() if value is not None) or "none"
    return (
        f"---\n{yaml.safe_dump(header, sort_keys=False)}---\n\n# Flywheel trajectories\n\n"
        f"{summary.rows} trajectories ({summary.tokens} tokens) exported by `flywheel export` at "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC, in {len(summary.shards)} {fmt} shard(s). Filters: "
        f"{chosen}.\n\nOne row per training sample: `token_ids`, `loss_mask` (true on trained tokens), "
        "behaviour `logprobs` (float32) and per-token policy `versions` (-1: not generated), its `reward` "
        "and sampling `temperature`, the session, group and completions it came from, the session's "
        "`task` and `metadata` as JSON text, and `created_at` (UTC). See Flywheel's docs/architecture.md, "
        "\"Vocabulary\".\n"
    )


def run_export(config: FlywheelConfig, args: argparse.Namespace) -> int:
    """`flywheel export`: write the dataset; the exit status."""
    from tqdm import tqdm

    filt = TrajectoryFilter(run=args.run, min_version=args.min_version, max_version=args.max_version,
                            min_reward=args.min_reward, since=args.since, until=args.until,
                            consumed=args.consumed)
    check_database(config.storage)
    try:
        data, earlier = prepare_out(args.out, args.overwrite)
    except FileExistsError as exc:
        print(f"flywheel: {exc}", file=sys.stderr)
        return 1
    writer = ShardedWriter(data, args.format, args.shard_rows, replace=earlier)
    bar = tqdm(unit="rows", desc="export", file=sys.stderr, disable=None)

    def progress(total: int | None, done: int) -> None:
        if total is not None:
            bar.reset(total=total)
        bar.update(done)

    async def export() -> ExportSummary:
        async with opened(config.storage) as session_factory:
            return await export_trajectories(session_factory, filt, writer, args.batch_rows, progress)

    try:
        summary = asyncio.run(export())
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    (args.out / CARD).write_text(dataset_card(summary, args.format, asdict(filt)))
    print(f"exported {summary.rows} trajectories ({summary.tokens} tokens) into {len(summary.shards)} "
          f"{args.format} shard(s) under {data}")
    return 0
