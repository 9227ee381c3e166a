"""Data-parallel training on Ray: N ranks, each a `Policy` in DistributedDataParallel.

group.py reserves the ranks' placement group and names their rendezvous; worker.py is the rank actor
(a `Policy` that joins the torch.distributed group: gloo on CPU, NCCL on GPU); handle.py is the driver's
`PolicyHandle` over the ranks (train_step on every rank, save on rank 0, load on every rank).
"""
