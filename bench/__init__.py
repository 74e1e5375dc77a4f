"""The benchmarks, run from the repository root as ``python -m bench.<name>`` (``bench/README.md``).

Every figure is measured against its baseline in the same run and printed as a ratio beside the absolute
figures; method and latest results: ``docs/performance.md``.
"""
