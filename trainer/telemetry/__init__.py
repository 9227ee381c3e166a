"""Where the trainer's metrics go besides its log and `<run dir>/metrics.jsonl`: sinks the `Monitor` feeds
(`base.py`), built from the trainer's config by `sinks.open_sinks`: TensorBoard event files, a Weights &
Biases run and an MLflow run, each through its own library, imported only when configured. The Prometheus
endpoint is `trainer/metrics.py`."""
