"""Running the real Codex CLI (`codex exec`) against a proxy, configured as integrations/codex/README.md
says (the config.toml of `integrations.codex.config`), in a CODEX_HOME and HOME of its own."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from integrations.codex.config import KEY_ENV, config_toml
from tests.support.node_agents import node_env

# No approval prompts, and no sandbox: Codex's bubblewrap sandbox needs user namespaces, which some
# containers lack, and the workspace is the test's temporary directory. `--strict-config` refuses a key
# this Codex does not know, so the README's config is checked too.
EXEC_FLAGS = ("--json", "--strict-config", "--skip-git-repo-check",
              "--dangerously-bypass-approvals-and-sandbox")
UNSET = ("OPENAI_API_KEY", "OPENAI_BASE_URL", "CODEX_API_KEY")  # the config names the only endpoint


@dataclass
class CodexRun:
    returncode: int
    last_message: str
    events: list[dict[str, Any]]  # `--json`: one object per stdout line
    stderr: str

    def items(self, kind: str) -> list[dict[str, Any]]:
        """The completed items of this type (`command_execution`, `agent_message`, ...)."""
        return [event["item"] for event in self.events
                if event.get("type") == "item.completed" and event["item"].get("type") == kind]


def run_codex(
    codex: Path, base_url: str, key: str, model: str, prompt: str, home: Path, workdir: Path,
    context_window: int | None = None, timeout_s: float = 300,
) -> CodexRun:
    """`codex exec` once, in `workdir`, with the config written to `home`/.codex/config.toml."""
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True)
    (codex_home / "config.toml").write_text(config_toml(base_url, model, context_window))
    last = home / "last_message.txt"
    env = {name: value for name, value in node_env().items() if name not in UNSET}
    env.update({"HOME": str(home), "CODEX_HOME": str(codex_home), KEY_ENV: key})
    done = subprocess.run(
        [str(codex), "exec", *EXEC_FLAGS, "--cd", str(workdir), "--output-last-message", str(last), prompt],
        env=env, cwd=workdir, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s,
        check=False,
    )
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return CodexRun(done.returncode, last.read_text().strip() if last.exists() else "", events, done.stderr)
