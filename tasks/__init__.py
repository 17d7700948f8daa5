"""The benchmarks eval.py runs: one module per sub-command, behind the interface in tasks/common.py."""
