"""Device peak FLOP/s, the denominator of model FLOPs utilisation (MFU); the numerator of a native model comes from
`models.flops.train_flops_per_example`."""

# Dense peak TFLOP/s for 16-bit matmul inputs, by `device_kind` prefix, from the vendors' datasheets (H100/H200 SXM:
# 989; A100: 312; TPU v4: 275, v5e: 197, v5p: 459, v6e: 918). float32 work is counted against the same figure, so its
# utilisation is a lower bound.
PEAK_TFLOPS = {
    "NVIDIA H100": 989.0,
    "NVIDIA H200": 989.0,
    "NVIDIA A100": 312.0,
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,
    "TPU v5e": 197.0,
    "TPU v5p": 459.0,
    "TPU v5": 459.0,
    "TPU v6": 918.0,
}


def peak_tflops(device):
    """The dense 16-bit peak TFLOP/s of a `jax.Device`, or None for a device not in the table (CPUs)."""
    kind = getattr(device, "device_kind", "")
    return next((peak for prefix, peak in PEAK_TFLOPS.items() if kind.startswith(prefix)), None)
