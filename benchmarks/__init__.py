"""Benchmarks of residency: phase-transition latency against the copy floor, and peers side by side.

    python -m pytest benchmarks/ --benchmark-json=bench.json     # the suite (pytest-benchmark)
    python -m benchmarks.report --run --out benchmarks/results/   # suite + JSON summary + PNG plot
    python -m benchmarks.gpu_check --out benchmarks/results/      # the prepared check for one GPU

See benchmarks/README.md for what each case measures and the goals.
"""
