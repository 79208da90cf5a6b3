"""What the TPU compilers make of the project's Mosaic kernels, without a TPU: one markdown table per question.

  make test-tpu                                                         # builds .venv-tpu (and runs the tier)
  .venv-tpu/bin/python scripts/tpu_compile_report.py                    # every case, compiled (kernels/README.md)
  .venv-tpu/bin/python scripts/tpu_compile_report.py --min_vmem --generations=v5p
  .venv-tpu/bin/python scripts/tpu_compile_report.py --search           # the largest tiles per generation

Rows are `kernels.tpu_compile.cases(generation)`: flash attention at representative settings, the LLaMA-7B and -70B
MLP and head, ring and Ulysses attention over the slice, each forward and backward in one program with the default
block sizes: whether it compiles, the VMEM the kernels state they need, the least scoped VMEM limit the compiler
accepts (`--min_vmem`: a bisection of libtpu's `xla_tpu_scoped_vmem_limit_kib`, some ten compiles a row), HBM per
device and the compile's seconds. `--search` instead finds, per generation, the largest tiles of each block table
that compile under the default scoped VMEM (the tables in kernels/attention/api.py and kernels/matmul/_blocks.py).
"""
import os
import time

# libtpu compiles for compile-only devices; JAX itself runs on the CPU (no TPU is attached).
for _name, _value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_ACCELERATOR_TYPE", "v5p-8"),
                      ("TPU_WORKER_HOSTNAMES", "localhost"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
                      ("JAX_PLATFORMS", "cpu")):
    os.environ.setdefault(_name, _value)

from absl import flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("generations", ["v4", "v5e", "v5p", "v6e"], "TPU generations to compile for.")
flags.DEFINE_string("only", None, "Compile only the rows whose kernel or shape contains this.")
flags.DEFINE_bool("min_vmem", False, "Also bisect the least scoped VMEM limit each row compiles under.")
flags.DEFINE_bool("search", False, "Find the largest tiles of each block table instead of the compile report.")


def _outcome(result):
    return "ok" if result.overflow is None else f"{result.overflow.needed / 2**20:.1f} MiB"


def _search(tpu_compile, generations):
    print("| generation | table | largest tiles that compile | compiles tried (tiles: compiled, or the overflow) |")
    print("|---|---|---|---|")
    jobs = [(f"attention D{d} {'bwd' if bwd else 'fwd'}",
             lambda g, d=d, bwd=bwd: tpu_compile.search_attention(g, d, bwd))
            for d in (128, 256) for bwd in (False, True)]  # head dim 64 is padded to 128 lanes in VMEM
    jobs += [(f"matmul {op}", lambda g, op=op: tpu_compile.search_matmul(g, op))
             for op in ("matmul", "gated", "loss")]
    for generation in generations:
        for name, search in jobs:
            if FLAGS.only and FLAGS.only not in name:
                continue
            best, tried = search(generation)
            notes = ", ".join(f"{tiles}: " + " ".join(_outcome(r) for r in results) for tiles, results in tried.items())
            print(f"| {generation} | {name} | {best} | {notes} |", flush=True)


def main(argv):
    del argv
    try:
        import libtpu  # noqa: F401, PLC0415
    except ImportError:
        raise ValueError("libtpu is not installed; run this under .venv-tpu (make test-tpu builds it)") from None
    from kernels import tpu_compile

    unknown = set(FLAGS.generations) - set(tpu_compile.TOPOLOGIES)
    if unknown:
        raise ValueError(f"--generations={FLAGS.generations}; expected some of {list(tpu_compile.TOPOLOGIES)}")
    start = time.perf_counter()
    if FLAGS.search:
        _search(tpu_compile, FLAGS.generations)
    else:
        print(tpu_compile.REPORT_HEADER)
        for generation in FLAGS.generations:
            for case in tpu_compile.cases(generation):
                if FLAGS.only and FLAGS.only not in f"{case.kernel} {case.label}":
                    continue
                result = tpu_compile.compile_case(generation, case)
                least = tpu_compile.min_scoped_vmem(case.lower(generation)) if FLAGS.min_vmem else None
                print(tpu_compile.report_row(result, least), flush=True)
    print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    from engine.tasks import cli
    cli.run(main)
