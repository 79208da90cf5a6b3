"""Time and memory of the pipeline schedules side by side: a LLaMA-style stack's loss and gradients
(`engine.tasks.lm.lm_loss_fn`, `jax.value_and_grad`) on a `stage` mesh, the weights on `engine.auto_shard`'s layout,
each schedule compiled once in this process and then timed in interleaved rounds (GPipe, the interleaved schedule,
1F1B, GPipe, ...), so that the ratios compare programs run on the same machine at the same moment.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python scripts/bench_pipeline.py --stages=4 \
      --microbatches=8

Columns: ms a step (median over rounds), that over GPipe's, the schedule's idle share
(`models.pipeline.bubble_fraction`), the compiled program's temporaries per device and the bytes a device sends a
step (`engine.plan.collective_bytes`). On simulated CPU devices
every device's work shares the host's cores, so the time counts the computation each schedule runs, masked ticks
included; what a stage idles waiting for another shows only on real devices.
"""
import os
import statistics
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("stages", 4, "Pipeline stages (the mesh's `stage` axis); the other devices go to `data`.")
flags.DEFINE_integer("microbatches", 8, "Micro-batches a step (M).")
flags.DEFINE_integer("layers", 8, "Decoder layers (divisible by stages x virtual stages).")
flags.DEFINE_integer("hidden_size", 256, "Model width (heads of 64).")
flags.DEFINE_integer("seq_len", 128, "Tokens a row.")
flags.DEFINE_integer("rows", 32, "Rows a step (divisible by data x microbatches).")
flags.DEFINE_list("schedules", ["gpipe", "interleaved", "1f1b"], "Schedules to time: gpipe, interleaved (V = 2), 1f1b.")
flags.DEFINE_integer("rounds", 5, "Interleaved timing rounds.")
flags.DEFINE_integer("steps", 5, "Steps a round, each timed to completion.")
flags.DEFINE_enum("family", "llama", ["llama", "mixtral"], "The stack's family: llama (dense) or mixtral (a mixture "
                  "of experts, 4 experts of the same width, its router losses in the loss).")

SCHEDULES = {"gpipe": dict(pipeline_schedule="gpipe"), "1f1b": dict(pipeline_schedule="1f1b"),
             "interleaved": dict(pipeline_schedule="gpipe", pipeline_virtual_stages=2)}


def main(argv):
    del argv
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import engine
    import kernels
    import models
    from engine import plan
    from engine.tasks import lm
    from models import pipeline

    unknown = [s for s in FLAGS.schedules if s not in SCHEDULES]
    if unknown:
        raise app.UsageError(f"--schedules={','.join(FLAGS.schedules)}; expected names among {sorted(SCHEDULES)}")
    devices = jax.device_count()
    if devices % FLAGS.stages:
        raise app.UsageError(f"--stages={FLAGS.stages} does not divide the {devices} devices")
    mesh = engine.make_mesh(stage=FLAGS.stages, data=devices // FLAGS.stages)
    heads = FLAGS.hidden_size // 64
    base = dict(scan_layers=True, remat="full", num_layers=FLAGS.layers, hidden_size=FLAGS.hidden_size,
                intermediate_size=4 * FLAGS.hidden_size, num_heads=heads, num_kv_heads=heads, vocab_size=512,
                max_position_embeddings=FLAGS.seq_len, pipeline_microbatches=FLAGS.microbatches)
    ids = jax.random.randint(jax.random.PRNGKey(1), (FLAGS.rows, FLAGS.seq_len + 1), 0, 512)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "segment_ids": jax.numpy.ones_like(ids[:, 1:])}
    placed_batch = jax.device_put(batch, NamedSharding(mesh, P("data")))

    runs = {}
    for name in FLAGS.schedules:
        model = models.create_model(FLAGS.family, "tiny", **base, **SCHEDULES[name])
        params = models.init_params(model, jax.random.PRNGKey(0))
        loss_fn = lm.lm_loss_fn(model)
        loss = lambda p, b, loss_fn=loss_fn: loss_fn(p, b, None, False)[0]  # noqa: E731
        specs = engine.auto_shard(params, mesh, trace_fn=lambda p, loss=loss: loss(p, batch))
        placed = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                                     is_leaf=lambda x: isinstance(x, P)))

        def value_and_grad(p, b, loss=loss):
            with kernels.under_mesh(mesh):
                return jax.value_and_grad(loss)(p, b)

        start = time.perf_counter()
        compiled = jax.jit(value_and_grad).lower(placed, placed_batch).compile()
        jax.block_until_ready(compiled(placed, placed_batch))
        config = model.config
        runs[name] = dict(fn=compiled, args=(placed, placed_batch), times=[],
                          compile=time.perf_counter() - start,
                          temp=compiled.memory_analysis().temp_size_in_bytes,
                          sent=sum(plan.collective_bytes(compiled.as_text(), devices).values()),
                          idle=pipeline.bubble_fraction(FLAGS.stages, FLAGS.microbatches,
                                                        config.pipeline_virtual_stages, config.pipeline_schedule))
        print(f"{name}: compiled in {runs[name]['compile']:.1f} s", flush=True)

    for _ in range(FLAGS.rounds):
        for run in runs.values():
            start = time.perf_counter()
            for _ in range(FLAGS.steps):
                jax.block_until_ready(run["fn"](*run["args"]))
            run["times"].append((time.perf_counter() - start) / FLAGS.steps)

    reference = statistics.median(runs["gpipe"]["times"]) if "gpipe" in runs else None
    print(f"\n{os.environ.get('XLA_FLAGS', '')}: stage {FLAGS.stages} x data {devices // FLAGS.stages}, "
          f"M = {FLAGS.microbatches}, {FLAGS.layers} layers of width {FLAGS.hidden_size}, {FLAGS.rows} rows of "
          f"{FLAGS.seq_len} tokens, medians of {FLAGS.rounds} rounds x {FLAGS.steps} steps")
    print(f"{'schedule':<12} {'ms / step':>10} {'x GPipe':>8} {'idle share':>11} {'temporaries MB':>15} "
          f"{'sent MB':>8}")
    for name, run in runs.items():
        ms = statistics.median(run["times"])
        ratio = f"{ms / reference:.3f}" if reference else "-"
        print(f"{name:<12} {1e3 * ms:>10.1f} {ratio:>8} {run['idle']:>11.3f} {run['temp'] / 1e6:>15.2f} "
              f"{run['sent'] / 1e6:>8.2f}")


if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    app.run(main)
