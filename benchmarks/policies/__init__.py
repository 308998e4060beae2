"""The policy experiments (issue 5's grid, head-to-head rounds and target tables), outside the
installed package: ``python -m benchmarks.policies [--quick] [--preset gpu] [--out
benchmarks/results]`` from the repository root.

bench.py runs the grid and writes the results; head_to_head.py times the contenders beside their
references; targets.py reads the targets from a results file; workloads.py makes the copy-heavy,
continuation and mixed request sets.
"""
