"""NVIDIA TensorRT-LLM's Scaffolding agent framework on Flywheel: controllers and workers as Scaffolding
defines them, with generation through the proxy (one session per sample) and rewards over the RL API.

- `api`: the one import point of the Scaffolding names (`tensorrt_llm.scaffolding`, else `compat`).
- `compat`: our own compatible implementation of the parts used here.
- `sessions`: session pools and how a task is bound to its session.
- `rl_tasks`, `rl_worker`: RL control API calls as tasks, and the worker running them.
- `workers`: `FlywheelWorker` (generation on a session key) and `flywheel_workers`.
- `reward_controller`: rewards by a server-side hook or a local function.
- `controllers`: majority vote and best-of-N over sessions.
- `trajectory`: `FlywheelTrajectoryMaker`, one group per prompt.
- `gsm8k`, `cli`: the GSM8K example and `python -m integrations.scaffoldings`.
"""
