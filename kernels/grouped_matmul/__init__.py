"""Grouped matmul: one weight per group of rows, ragged group sizes (`grouped_matmul`), for mixture-of-experts layers.

`api.py` holds the op (checks, tiles, custom_vjp), `reference.py` the plain-JAX backend and the interface every
backend implements, `triton.py` / `mosaic_tpu.py` the Pallas kernels, `_groups.py` the group offsets and the
(row tile, group) visits the kernels walk, `_cost.py` their cost estimates.
"""
from kernels.grouped_matmul.api import TRACE_NAME, grouped_matmul

__all__ = ["TRACE_NAME", "grouped_matmul"]
