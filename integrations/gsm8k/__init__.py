"""The Flywheel demo agent: solves GSM8K-style math word problems through the proxy with the `openai`
client; the proxy's `math` reward hook grades each attempt (or, with grading "rest", the agent rewards it
over the RL REST API). An ordinary program: it imports nothing of Flywheel's services, only this package.

- `problems`: GSM8K (Hub), GSM8K-format JSONL, or an offline generator; disjoint train/held-out splits.
- `scoring`: final-answer extraction and the reward rule (grading "rest", and held-out accuracy).
- `rl_api`: a thin client of the RL control API (`RLClient`, `FlywheelAPIError`).
- `agent`: `MathAgent`, `rollout_group`, `evaluate`.
- `loop`: `run_agent_loop` (evaluate, rounds of groups, evaluate) and its JSON report.
- `cli`: `python -m integrations.gsm8k`.
"""
