"""Benchmarks: ``python -m bench`` compares the project with named baselines on identical work (see
:mod:`bench.harness`); the other modules (``bench.decode``, ``bench.train``, ...) measure one thing each."""
