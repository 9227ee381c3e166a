"""Weight-update strategies, one file each behind the `WeightSync` seam of `sync.py`:

- `disk`: every worker reads the version's safetensors checkpoint from a filesystem it shares with the
  trainer (`/update_weights_from_disk`); the default.
- `distributed`: the policy actor broadcasts the checkpoint's tensors over a process group every worker
  joined (`/update_weights_from_distributed`; NCCL on GPU, gloo with the CPU engine), for workers on
  machines without a shared filesystem.
- `lora`: LoRA training's adapter, loaded on every worker under one name (`/load_lora_adapter`).
"""
