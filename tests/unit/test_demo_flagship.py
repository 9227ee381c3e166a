"""flywheel/demo.py's flagship runs: on a GPU, AReaL's GSM8K quickstart on our keys (so the two can be
compared), on a CPU SmolLM2-135M; the user's own values win either way. And the report's line naming
where the problems came from (integrations/gsm8k/cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flywheel.config import load_config
from flywheel.demo import GPU_RUN, demo_overrides, resolved_hardware
from integrations.gsm8k.cli import data_source


def resolved(overrides: list[str], tmp_path: Path) -> dict[str, object]:
    config = load_config(None, demo_overrides(None, [f"run.dir={tmp_path}", *overrides]))
    return {
        "backend": config.serving.backend, "model": config.serving.model, "group": config.demo.group_size,
        "tokens": config.demo.max_tokens, "lr": config.trainer.lr,
        "eps_clip": config.trainer.algorithm.loss.eps_clip, "eta": config.trainer.max_head_offpolicyness,
        "batch": config.trainer.batch_size,
    }


def test_the_gpu_run_is_areals_quickstart(tmp_path: Path) -> None:
    assert resolved(["demo.hardware=gpu"], tmp_path) == {
        "backend": "sglang", "model": "Qwen/Qwen2.5-1.5B-Instruct", "group": 4, "tokens": 1024, "lr": 1.7e-5,
        "eps_clip": 0.4, "eta": 2, "batch": 4 * 256,
    }
    mine = resolved(["demo.hardware=gpu", "demo.group_size=8", "trainer.lr=3e-6"], tmp_path)
    assert (mine["group"], mine["lr"], mine["batch"]) == (8, 3e-6, 8 * 256)  # the user's values win
    assert set(GPU_RUN) >= {"serving.backend", "serving.model", "trainer.lr"}


def test_the_cpu_run_is_the_small_model_on_the_cpu_engine(tmp_path: Path) -> None:
    cpu = resolved(["demo.hardware=cpu"], tmp_path)
    assert (cpu["backend"], cpu["model"], cpu["group"], cpu["lr"], cpu["eta"]) == ("cpu", "demo", 8, 1e-5, 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_auto_picks_the_cpu_run_without_a_gpu(tmp_path: Path) -> None:
    assert resolved_hardware(load_config(None, [f"run.dir={tmp_path}"])) == "cpu"


def test_the_report_names_its_problems() -> None:
    assert data_source({"source": "jsonl", "jsonl": "/d/train.jsonl", "eval_source": "jsonl",
                        "train_problems": 6, "eval_problems": 4}) == \
        "GSM8K-format JSONL /d/train.jsonl (6 train, 4 held-out)"
    assert data_source({"source": "generated", "eval_source": "generated", "train_problems": 2,
                        "eval_problems": 0}).startswith("generated GSM8K-style problems (offline fallback)")
    assert "held-out: GSM8K-format JSONL /d/test.jsonl" in data_source(
        {"source": "gsm8k", "eval_source": "jsonl", "eval_jsonl": "/d/test.jsonl", "train_problems": 1,
         "eval_problems": 1})
