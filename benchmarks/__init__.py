"""fedmvp's benchmark suite: ``python -m benchmarks --help`` (see benchmarks/suite.py)."""
