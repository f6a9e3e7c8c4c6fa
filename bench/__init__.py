"""Benchmarks. `bench.serving` is the user's `specserve bench` (datasets, client, runner, report,
peers); the modules beside it are experiment tools run as `python -m bench.<name>` (kernel, step
and planner measurements) that may import the harness, never the other way round.
"""
