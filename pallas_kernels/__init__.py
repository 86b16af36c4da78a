"""GPU kernels for SageBwd attention: Triton (`jax_triton`, any NVIDIA GPU) and
Mosaic GPU through Pallas (`mosaic`, Hopper), with the rules they share."""
