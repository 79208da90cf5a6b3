"""The step-time cost of local checkpoints (`engine.Checkpointing(local_dir=..., local_every=...)`): the same
training run without a local tier and with local saves every `--every` updates, rounds interleaved, medians of the
steady time per step, the last local write included (the persistent tier is not saved inside the timed steps),
and the blocking part of a local save (`fit`'s time in its saves, from the workdir's goodput.json). With
`--processes=2` the run is two processes of 4 CPU devices each (gloo between them), and each interval is also timed
with a peer replica (`local_replicas=1`: each save sends the process's blocks to the other process). Prints a table.

  .venv/bin/python scripts/bench_checkpoint.py --state_mb=100 --every=10,1 --rounds=3 --local_dir=/dev/shm
  .venv/bin/python scripts/bench_checkpoint.py --state_mb=100 --every=10 --rounds=3 --processes=2
"""
import json
import os
import socket
import statistics
import subprocess
import sys
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
flags.DEFINE_integer("processes", 1, "1: one process of 8 CPU devices; 2: two processes of 4, replicas timed too.")
flags.DEFINE_string("coordinator", None, "Set by --processes=2 for the processes it starts.")
flags.DEFINE_integer("process_id", None, "Set by --processes=2 for the processes it starts.")
flags.DEFINE_string("shared_dir", None, "Set by --processes=2: where the processes' shared workdirs go.")


def run_once(every, replicas, workdir, local_dir):
    """(seconds per update of `FLAGS.steps` updates with local saves every `every` (0: no local tier) and
    `replicas` peer replicas, seconds a local save blocked the loop (None without saves), state MB)."""
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
    checkpointing = (engine.Checkpointing(local_dir=local_dir, local_every=every, local_replicas=replicas)
                     if every else engine.Checkpointing())
    trainer = engine.Trainer(mesh=engine.make_mesh(data=8), collate_fn=collate, loss_fn=loss_fn, params=params,
                             optimizer=optax.adam(1e-4), workdir=workdir, checkpointing=checkpointing)
    trainer.fit(rows, per_device_batch_size=2, max_steps=2, checkpoint_at_end=False, log_every=1000)
    if every:
        trainer.save_checkpoint(local=True)  # a first save outside the timing (the local directory made, compiled)
    trainer.close()
    jax.block_until_ready(trainer.params)
    start = time.perf_counter()
    trainer.fit(rows, per_device_batch_size=2, max_steps=2 + FLAGS.steps, n_epochs=10 ** 6, checkpoint_at_end=False,
                log_every=1000)
    jax.block_until_ready(trainer.params)
    trainer.close()  # the last local write included
    seconds = (time.perf_counter() - start) / FLAGS.steps
    saves, blocked = every and (2 + FLAGS.steps) // every - 2 // every, None
    if saves and jax.process_index() == 0:  # process 0 writes the record
        with open(os.path.join(workdir, "goodput.json")) as f:
            blocked = json.load(f)[-1]["checkpoint_s"] / saves  # the timed call's record
    return seconds, blocked, sum(x.nbytes for x in jax.tree.leaves(params)) * 3 / 1e6


def _start_processes(argv):
    """Runs this script as two processes of 4 CPU devices each; returns the first one's exit status."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    with tempfile.TemporaryDirectory() as shared:
        procs = [subprocess.Popen([sys.executable, *argv, f"--coordinator=localhost:{port}", f"--process_id={i}",
                                   f"--shared_dir={shared}"], env=env,
                                  stdout=None if i == 0 else subprocess.DEVNULL) for i in range(2)]
        return [p.wait() for p in procs][0]


def main(argv):
    if FLAGS.processes == 2 and FLAGS.process_id is None:
        sys.exit(_start_processes(sys.argv))
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    if FLAGS.process_id is not None:
        import engine
        engine.initialize_distributed(FLAGS.coordinator, 2, FLAGS.process_id)
    rows = [(0, 0)] + [(int(e), r) for e in FLAGS.every for r in ((0, 1) if FLAGS.processes == 2 else (0,))]
    times, blocked = {row: [] for row in rows}, {row: [] for row in rows}
    for round_ in range(FLAGS.rounds):
        for every, replicas in rows:
            # A local directory per run and process (a host's own disk), deleted after the run; the workdir is
            # shared by the processes.
            with tempfile.TemporaryDirectory() as workdir, tempfile.TemporaryDirectory(dir=FLAGS.local_dir) as local:
                if FLAGS.shared_dir:
                    workdir = os.path.join(FLAGS.shared_dir, f"{round_}-{every}-{replicas}")
                seconds, blocked_s, state_mb = run_once(every, replicas, workdir, local)
            times[every, replicas].append(seconds)
            blocked[every, replicas].append(blocked_s)
    if FLAGS.process_id:
        return
    print(f"state {state_mb:.1f} MB, {FLAGS.steps} updates a run, {FLAGS.rounds} rounds, local_dir {FLAGS.local_dir}, "
          f"{FLAGS.processes} process(es)")
    print("| local saves | ms / update (median) | cost over none (median of rounds) | a save blocks (ms, median) |")
    print("|---|---|---|---|")
    for row in rows:
        ratios = [t / b for t, b in zip(times[row], times[0, 0])]
        every, replicas = row
        name = "none" if every == 0 else f"every {every}" + (", a peer replica" if replicas else "")
        save = "—" if every == 0 else f"{1e3 * statistics.median(blocked[row]):.0f}"
        print(f"| {name} | {1e3 * statistics.median(times[row]):.1f} | "
              f"{100 * (statistics.median(ratios) - 1):+.1f} % | {save} |")


if __name__ == "__main__":
    app.run(main)
