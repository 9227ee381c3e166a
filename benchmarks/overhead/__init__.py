"""Pieces of benchmarks/proxy_overhead.py: the zero-latency worker, the bare passthrough, the stacks
under test and the load generator."""
