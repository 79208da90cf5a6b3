"""Placeholder: the Pallas kernels land in a following commit."""


def forward(q, k, v, q_ids, kv_ids, plan):
    raise NotImplementedError("implementation='mosaic_tpu' is not written yet; use implementation='xla'")


def backward(q, k, v, q_ids, kv_ids, out, lse, do, plan):
    raise NotImplementedError("implementation='mosaic_tpu' is not written yet; use implementation='xla'")
