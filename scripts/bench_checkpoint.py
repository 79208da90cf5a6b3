"""The step-time cost of local checkpoints (`engine.Checkpointing(local_dir=..., local_every=...)`): the same
training run without a local tier and with local saves every `--every` updates, rounds interleaved, medians of the
steady time per step, the last local write included (the persistent tier is not saved inside the timed steps).
Prints a table.

  .venv/bin/python scripts/bench_checkpoint.py --state_mb=100 --every=10,1 --rounds=3 --local_dir=/dev/shm
"""
import os
import statistics
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_float("state_mb", 100.0, "Size of the training state (parameters and AdamW's two moments), MB.")
flags.DEFINE_list("every", ["10", "1"], "Local save intervals to time beside none (10: Checkpointing's default).")
flags.DEFINE_integer("rounds", 3, "Interleaved rounds.")
flags.DEFINE_integer("steps", 40, "Timed updates per run (after a 2-step warm-up that compiles).")
flags.DEFINE_string("local_dir", "/dev/shm" if os.path.isdir("/dev/shm") else None,
                    "Fast local storage for the local tier (default /dev/shm where it exists).")


def run_once(every, workdir):
    """Seconds per update of `FLAGS.steps` updates with local saves every `every` (0: no local tier)."""
    import jax
    import numpy as np
    import optax

    import engine
    width = 1024
    layers = max(1, round(FLAGS.state_mb * 1e6 / (3 * 4 * width * width)))  # params + two Adam moments, float32
    params = {f"w{i}": np.random.RandomState(i).normal(0, width ** -0.5, (width, width)).astype(np.float32)
              for i in range(layers)}

    def loss_fn(params, batch, rng, is_training):
        x = batch["x"]
        for i in range(layers):
            x = jax.numpy.tanh(x @ params[f"w{i}"])
        return ((x - batch["y"]) ** 2).mean(), {}

    rows = [{"x": np.random.RandomState(i).normal(size=width).astype(np.float32),
             "y": np.zeros(width, np.float32)} for i in range(64)]
    collate = lambda examples: {k: np.stack([e[k] for e in examples]) for k in ("x", "y")}  # noqa: E731
    checkpointing = (engine.Checkpointing(local_dir=FLAGS.local_dir, local_every=every) if every else
                     engine.Checkpointing())
    trainer = engine.Trainer(mesh=engine.make_mesh(data=8), collate_fn=collate, loss_fn=loss_fn, params=params,
                             optimizer=optax.adam(1e-4), workdir=workdir, checkpointing=checkpointing)
    trainer.fit(rows, per_device_batch_size=2, max_steps=2, checkpoint_at_end=False, log_every=1000)
    if every:
        trainer.save_checkpoint(local=True)  # a first save outside the timing (the local directory made)
    trainer.close()
    jax.block_until_ready(trainer.params)
    start = time.perf_counter()
    trainer.fit(rows, per_device_batch_size=2, max_steps=2 + FLAGS.steps, n_epochs=10 ** 6, checkpoint_at_end=False,
                log_every=1000)
    jax.block_until_ready(trainer.params)
    trainer.close()  # the last local write included
    seconds = (time.perf_counter() - start) / FLAGS.steps
    return seconds, sum(x.nbytes for x in jax.tree.leaves(params)) * 3 / 1e6


def main(argv):
    del argv
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    intervals = [0] + [int(e) for e in FLAGS.every]
    times = {e: [] for e in intervals}
    for _ in range(FLAGS.rounds):
        for every in intervals:
            with tempfile.TemporaryDirectory() as workdir:
                seconds, state_mb = run_once(every, workdir)
            times[every].append(seconds)
    print(f"state {state_mb:.1f} MB, {FLAGS.steps} updates a run, {FLAGS.rounds} rounds, local_dir {FLAGS.local_dir}")
    print("| local saves | ms / update (median) | cost over none (median of rounds) |")
    print("|---|---|---|")
    for every in intervals:
        ratios = [t / b for t, b in zip(times[every], times[0])]
        name = "none" if every == 0 else f"every {every}"
        print(f"| {name} | {1e3 * statistics.median(times[every]):.1f} | "
              f"{100 * (statistics.median(ratios) - 1):+.1f} % |")


if __name__ == "__main__":
    app.run(main)
