"""``python -m benchmarks``: see benchmarks/suite.py."""

from benchmarks.suite import main

main()
