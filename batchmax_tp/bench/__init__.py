"""Benchmark libraries: what the ``launch/bench_*.py`` scripts run, importable by tests (no script loaded by path).

A layer above the job's own (``eval``, ``models``): a benchmark builds on everything the package offers.
"""
