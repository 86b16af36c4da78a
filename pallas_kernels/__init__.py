"""Pallas GPU kernels for SageBwd attention."""
