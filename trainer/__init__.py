"""The trainer: pure algorithm functions, the Ray policy actor, weight sync, checkpoints, the loop.

config.TrainerConfig → runner.run_trainer starts Ray, the policy actor (policy.Policy) or its
data-parallel ranks (distributed/), and the driver (driver.Driver: claim → train_step → save → push →
record_step). batching turns claimed trajectories into tensors and packing splits them into micro-batches;
algos/ holds the maths; checkpoint writes model directories (or LoRA adapters, lora) with the trainer
state a resume needs (train_state); weights/ pushes them to the workers (one file per strategy); monitor
logs and stores per-step metrics.
"""
