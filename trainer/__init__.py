"""The trainer: pure algorithm functions, the Ray policy actor, weight sync, checkpoints, the loop.

config.TrainerConfig → runner.run_trainer starts Ray, the policy actor (policy.Policy) and the
driver (driver.Driver: claim → train_step → save → push → record_step). batching turns claimed
trajectories into tensors; algos/ holds the maths; checkpoint writes model directories; weights/
pushes them to the workers (one file per strategy); monitor logs and stores per-step metrics.
"""
