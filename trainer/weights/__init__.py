"""Weight-update strategies, one file each behind the `WeightSync` seam of `sync.py`: `disk` pushes a
safetensors checkpoint that every worker reads from a shared filesystem (the default).
"""
