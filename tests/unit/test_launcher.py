"""The SGLang launcher: the command it builds (checked against sglang 0.5.23's own flag list) and the
process handling, with a stand-in interpreter that serves the scripted worker instead of sglang."""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import textwrap
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from serving.client import SGLangClient
from serving.config import ClientConfig, SGLangLaunchConfig
from serving.errors import WorkerLaunchError
from serving.launcher import build_sglang_command, launch_sglang_worker, redact_command
from tests.support.scripted_worker import eventually
from tests.support.sglang_schema import default_cache_dir

REPO_ROOT = Path(__file__).resolve().parents[2]


# ---- the command ----------------------------------------------------------------------------------


def test_minimal_command_leaves_unset_flags_out() -> None:
    command = build_sglang_command("Qwen/Qwen3-0.6B", 30001, "127.0.0.1", SGLangLaunchConfig())
    assert command == [
        "python", "-m", "sglang.launch_server",
        "--model-path", "Qwen/Qwen3-0.6B",
        "--host", "127.0.0.1",
        "--port", "30001",
        "--tp-size", "1",
    ]


def test_full_command_with_extra_args_last_in_order() -> None:
    config = SGLangLaunchConfig(
        python="/opt/venv/bin/python", tp_size=2, mem_fraction_static=0.8, context_length=8192,
        dtype="bfloat16", admin_api_key="s3cret",
        extra_args=["--skip-server-warmup", "--weight-version", "0", "--mem-fraction-static", "0.7"],
    )
    command = build_sglang_command("/ckpt/base", 30002, "0.0.0.0", config, served_model_name="policy")
    assert command[:3] == ["/opt/venv/bin/python", "-m", "sglang.launch_server"]
    pairs = dict(zip(command[3:13:2], command[4:14:2], strict=True))
    assert pairs == {
        "--model-path": "/ckpt/base", "--host": "0.0.0.0", "--port": "30002", "--tp-size": "2",
        "--mem-fraction-static": "0.8",
    }
    assert command[13:21] == [
        "--context-length", "8192", "--dtype", "bfloat16",
        "--served-model-name", "policy", "--admin-api-key", "s3cret",
    ]
    # verbatim and last, so a later flag overrides an earlier one in argparse
    assert command[21:] == ["--skip-server-warmup", "--weight-version", "0", "--mem-fraction-static", "0.7"]


def test_each_optional_flag_is_independent() -> None:
    only_dtype = build_sglang_command("m", 1, "h", SGLangLaunchConfig(dtype="float16"))
    assert "--dtype" in only_dtype
    for absent in ("--mem-fraction-static", "--context-length", "--served-model-name", "--admin-api-key"):
        assert absent not in only_dtype


def test_redaction_hides_the_admin_key() -> None:
    command = build_sglang_command("m", 1, "h", SGLangLaunchConfig(admin_api_key="s3cret"))
    assert "s3cret" not in redact_command(command)
    assert redact_command(command)[-2:] == ["--admin-api-key", "***"]


def sglang_cli_flags(wheel: Path) -> set[str]:
    """Every flag of sglang's server_args, read from the wheel's `arg_groups/fields/*.py` source:
    `--field-name` unless `Arg(cli_name=...)` renames it, plus `Arg(aliases=[...])`."""
    flags: set[str] = set()
    with zipfile.ZipFile(wheel) as archive:
        members = [n for n in archive.namelist() if n.startswith("sglang/srt/arg_groups/fields/")]
        for member in members:
            for node in ast.walk(ast.parse(archive.read(member))):
                if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                    continue
                cli_name = "--" + node.target.id.replace("_", "-")
                for call in ast.walk(node.annotation):
                    for keyword in getattr(call, "keywords", []):
                        if keyword.arg == "cli_name":
                            cli_name = ast.literal_eval(keyword.value)
                        elif keyword.arg == "aliases":
                            flags.update(ast.literal_eval(keyword.value))
                flags.add(cli_name)
    return flags


def test_every_flag_exists_in_sglang_0_5_23(sglang_api_types: ModuleType) -> None:
    wheels = sorted(default_cache_dir().glob("sglang-*.whl"))
    if not wheels:
        pytest.skip("sglang 0.5.23 wheel not in the cache (only api_types.py is)")
    known = sglang_cli_flags(wheels[0])
    assert {"--tensor-parallel-size", "--model"} <= known  # aliases are read: the parser works
    config = SGLangLaunchConfig(
        mem_fraction_static=0.8, context_length=4096, dtype="bfloat16", admin_api_key="k"
    )
    ours = {arg for arg in build_sglang_command("m", 1, "h", config, "name") if arg.startswith("--")}
    assert ours <= known, ours - known
    assert {"--skip-server-warmup", "--weight-version"} <= known  # what users pass in extra_args


# ---- the process ----------------------------------------------------------------------------------


def fake_interpreter(tmp_path: Path, body: str) -> str:
    """An executable standing in for `python`: it receives `-m sglang.launch_server ...` in argv."""
    script = tmp_path / "fake-python"
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    script.chmod(0o755)
    return str(script)


SERVE_SCRIPTED_WORKER = """
    import os, sys
    args = sys.argv[1:]
    open(os.environ["ARGV_FILE"], "w").write("\\n".join(args))
    print("loading weights...", flush=True)
    from tests.support.scripted_worker import main
    main(["--host", args[args.index("--host") + 1], "--port", args[args.index("--port") + 1]])
"""


def env_for(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ARGV_FILE": str(tmp_path / "argv")}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


async def test_launch_waits_for_health_then_stop_ends_it(tmp_path: Path) -> None:
    python = fake_interpreter(tmp_path, SERVE_SCRIPTED_WORKER)
    config = SGLangLaunchConfig(python=python, startup_timeout_s=60)
    port = free_port()
    worker = await launch_sglang_worker(
        "/ckpt/base", port, config, served_model_name="policy", env=env_for(tmp_path),
        log_path=tmp_path / "sglang.log",
    )
    try:
        assert worker.url == f"http://127.0.0.1:{port}"
        assert worker.returncode is None
        async with SGLangClient(worker.url, ClientConfig()) as client:
            assert await client.health()
            answer = await client.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
            assert len(answer["output_ids"]) == 2
        argv = (tmp_path / "argv").read_text().split("\n")
        assert argv == worker.command[1:]
        assert argv[argv.index("--served-model-name") + 1] == "policy"
    finally:
        await worker.stop(timeout_s=10)
    assert worker.returncode is not None
    assert not alive(worker.process.pid)
    assert "loading weights..." in worker.output_tail()
    assert "loading weights..." in (tmp_path / "sglang.log").read_text()


async def test_early_exit_raises_with_the_last_output_lines(tmp_path: Path) -> None:
    crash = """
        import sys
        for i in range(80):
            print(f"log line {i}", flush=True)
        print("RuntimeError: CUDA error: out of memory", file=sys.stderr, flush=True)
        sys.exit(3)
    """
    config = SGLangLaunchConfig(python=fake_interpreter(tmp_path, crash), startup_timeout_s=60)
    with pytest.raises(WorkerLaunchError, match="exited with code 3") as raised:
        await launch_sglang_worker("m", free_port(), config, env=env_for(tmp_path))
    tail = raised.value.output_tail
    assert tail[-1] == "RuntimeError: CUDA error: out of memory"
    assert tail[-2] == "log line 79" and len(tail) == 50
    assert "CUDA error: out of memory" in str(raised.value)


async def test_never_healthy_times_out_and_kills_the_process_group(tmp_path: Path) -> None:
    hang = """
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(os.environ["ARGV_FILE"], "w").write(f"{os.getpid()} {child.pid}")
        print("stuck compiling kernels", flush=True)
        time.sleep(600)
    """
    config = SGLangLaunchConfig(python=fake_interpreter(tmp_path, hang), startup_timeout_s=1.5)
    with pytest.raises(WorkerLaunchError, match="not healthy") as raised:
        await launch_sglang_worker("m", free_port(), config, env=env_for(tmp_path))
    assert "stuck compiling kernels" in raised.value.output_tail
    leader, child = map(int, (tmp_path / "argv").read_text().split())
    await eventually(lambda: not alive(leader) and not alive(child))


@pytest.mark.gpu
async def test_real_sglang_server_serves_and_reloads(tmp_path: Path) -> None:
    """Needs sglang, a GPU, and FLYWHEEL_TEST_SGLANG_MODEL (a small local model directory)."""
    model = os.environ.get("FLYWHEEL_TEST_SGLANG_MODEL")
    if importlib.util.find_spec("sglang") is None or not model:
        pytest.skip("needs sglang installed and FLYWHEEL_TEST_SGLANG_MODEL")
    config = SGLangLaunchConfig(python=sys.executable, mem_fraction_static=0.3, admin_api_key="k")
    worker = await launch_sglang_worker(model, free_port(), config, log_path=tmp_path / "sglang.log")
    try:
        async with SGLangClient(worker.url, ClientConfig(admin_api_key="k")) as client:
            answer = await client.generate(
                {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}
            )
            assert len(answer["meta_info"]["output_token_logprobs"]) == len(answer["output_ids"])
            chunks = [c async for c in client.generate_stream({"text": "Hello", "sampling_params": {}})]
            assert chunks[-1]["meta_info"]["finish_reason"] is not None
            await client.pause_generation("retract")
            result = await client.update_weights_from_disk(model, weight_version=1)
            await client.continue_generation()
            assert result["success"] is True
            assert (await client.model_info())["weight_version"] == "1"
    finally:
        await worker.stop()


def test_flywheel_resolves_its_own_models_for_sglang(tmp_path):
    from flywheel.sglang_worker import sglang_model_path
    from serving.config import ServingConfig

    hub_id = "Qwen/Qwen2.5-0.5B-Instruct"
    assert sglang_model_path(ServingConfig(model=hub_id)) == hub_id
    tiny = sglang_model_path(ServingConfig(model="tiny", cache_dir=tmp_path))
    assert tiny.startswith(str(tmp_path)) and (tmp_path / "models").is_dir()
