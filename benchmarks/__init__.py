"""Benchmarks of the SageBwd op and its kernels, run from the repository root
as modules (`python -m benchmarks.attention`; benchmarks/README.md lists them).
Most need a GPU; none is imported by the package itself."""
