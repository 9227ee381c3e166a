"""Weight-update strategies, one file each: `disk` pushes a safetensors checkpoint to every worker.

There is deliberately no NCCL (`/update_weights_from_distributed`) strategy yet: it needs GPUs on
both sides and is not written, rather than shipped as an untested skeleton.
"""
