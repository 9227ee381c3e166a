#!/bin/sh
# The trainer's entrypoint on a Ray cluster (docker-compose.yml, service `trainer`): join the cluster at
# $FLYWHEEL_TRAINER__RAY__ADDRESS (trainer.ray.address) as a node of this container, then run
# `flywheel ARGS...` in its place. A Ray driver must run on a node of its cluster: `ray.init(address=...)`
# looks for a raylet on its own machine. This node offers no CPUs or GPUs, so the policy actor and the
# data-parallel ranks are placed on the worker nodes. Its ports are the other nodes' (docker-compose.yml).
set -eu
: "${FLYWHEEL_TRAINER__RAY__ADDRESS:?set it to the Ray head to join, host:port}"
ray start --address="$FLYWHEEL_TRAINER__RAY__ADDRESS" --num-cpus=0 --num-gpus=0 --disable-usage-stats \
    --node-manager-port=6380 --object-manager-port=6381 \
    --dashboard-agent-grpc-port=6382 --dashboard-agent-listen-port=6383 \
    --runtime-env-agent-port=6384 --metrics-export-port=6385 \
    --min-worker-port=11000 --max-worker-port=11999
exec flywheel "$@"
