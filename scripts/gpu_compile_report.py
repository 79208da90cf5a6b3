"""What the Hopper compiler makes of every Triton kernel of the project, without a GPU: one markdown table.

  make test-gpu-compile                                              # builds .venv-gpu-compile (and runs the tier)
  .venv-gpu-compile/bin/python scripts/gpu_compile_report.py         # the table kernels/README.md records
  .venv-gpu-compile/bin/python scripts/gpu_compile_report.py --only=attention --dump_dir=/tmp/kernels
  .venv/bin/python scripts/gpu_compile_report.py --roofline                # any JAX, no triton: arithmetic only

Each row is one kernel at its production shape and default block sizes (kernels/gpu_compile.py), lowered by JAX
(>= 0.11) for an abstract H200 and compiled to an sm_90a cubin by the `triton` package: warps / stages, shared
memory, registers per thread, spilled bytes; what Triton made of each tl.dot (wgmma, mma.sync or fma); the SASS's
HGMMA / HMMA instructions, the wgmma groups a wait leaves in flight, LDL / STL; whether the wgmma are serialized
(ptxas's advisory C7515 and kin, or HGMMAs issued one per group in the SASS); ptxas's advisories and the compile's
seconds. `--dump_dir` writes each kernel's Triton IR, TTGIR, PTX and SASS there, for reading what an advisory points
at. `--roofline` prints the H200 roofline of the main training path's ops instead (kernels/README.md).
"""
import os
import re
import time

from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string("only", None, "Compile only the cases whose name contains this (e.g. attention, gated_mlp).")
flags.DEFINE_bool("roofline", False, "Print the H200 roofline of the training path's ops (no compile).")
flags.DEFINE_string("dump_dir", None, "Write <kernel>.ttir / .ttgir / .ptx / .sass of every compiled kernel here.")

# Measured on an H200 (issue 44's device run): ms per call, ours beside the reference it was timed against.
_MEASURED = {
    "flash attention fwd+bwd, B2 H32/8 D128 T4096 causal": (("ours", 5.04), ("cuDNN", 2.35)),
    "flash attention fwd+bwd, B2 H32/8 D128 T8192 causal": (("ours", 18.1), ("cuDNN", 7.9)),
    "linear_cross_entropy fwd+bwd, 8192 x 2048 x 32000": (("ours", 13.2), ("bf16 logits", 9.7)),
}


def main(argv):
    del argv
    import jax

    if FLAGS.roofline:
        from kernels import gpu_compile
        print(gpu_compile.format_roofline(gpu_compile.roofline_cases(), _MEASURED))
        return

    try:
        import triton
    except ImportError:
        raise ValueError("the triton package is not installed; run this under .venv-gpu-compile "
                         "(make test-gpu-compile builds it)") from None
    if tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11):
        raise ValueError(f"jax {jax.__version__} cannot lower for an abstract GPU; expected >= 0.11 "
                         "(.venv-gpu-compile has 0.11.2)")
    from kernels import gpu_compile

    cases = {name: case for name, case in gpu_compile.production_cases().items()
             if not FLAGS.only or FLAGS.only in name}
    if not cases:
        raise ValueError(f"--only={FLAGS.only!r} matches no case; expected part of one of "
                         f"{list(gpu_compile.production_cases())}")
    start = time.perf_counter()
    reports = gpu_compile.report(cases)
    print(f"sm_90a, jax {jax.__version__}, triton {triton.__version__}")
    print(gpu_compile.format_table(reports))
    print(f"{len(reports)} kernels in {time.perf_counter() - start:.0f} s")
    if FLAGS.dump_dir:
        os.makedirs(FLAGS.dump_dir, exist_ok=True)
        for r in reports:
            stem = os.path.join(FLAGS.dump_dir, re.sub(r"[^A-Za-z0-9]+", "_", r.label).strip("_"))
            for ext, text in (("ttir", r.ttir), ("ttgir", r.ttgir), ("ptx", r.ptx), ("sass", r.sass_text)):
                with open(f"{stem}.{ext}", "w") as f:
                    f.write(text)
        print(f"IR of each kernel in {FLAGS.dump_dir}")


if __name__ == "__main__":
    from engine.tasks import cli
    cli.run(main)
