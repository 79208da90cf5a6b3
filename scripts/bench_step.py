"""Steady training-step time of the engine, side by side with RedCoast 0.4.23 and a framework-free jax.jit floor.

All three train the same tiny LLaMA-style model on the same data and mesh (`--peers_dir/tinylm.py`): a 2-step
warm-up, then the wall time of 20 steps. Runs are interleaved (engine, floor, RedCoast, engine, ...) in fresh
processes, and the table reports medians and the median of the per-round ratios, because single timings on a
2-core machine are noisy. `fit/direct` is the engine's 20 steps under `fit` over the same compiled step called 20
times directly on one placed batch: above 1 by `fit`'s own host work per step (data, logging, checks).
`in-process` is the engine's 20 steps under `fit` over the floor's 20 steps (`plain_step.py`'s own loop, collation
and placement included) alternated `--in_process_rounds` times inside one worker, after both are compiled: the
median of those ratios, free of the differences between processes that dominate the other columns. `host ms` is
`fit`'s own host work per step: HOST_STEPS steps under `fit` with the compiled step swapped for one that returns the
state as it is (data, placement, logging, checks and nothing else), next to the floor's loop without its step
(collation and `device_put`).

  .venv/bin/python scripts/bench_step.py --meshes=4x1x2,8x1x1 --rounds=3 --redco_python=/tmp/redco-venv/bin/python
"""
import contextlib
import io
import os
import runpy
import statistics
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS
flags.DEFINE_list("meshes", ["4x1x2"], "Meshes as data x fsdp x model, each multiplying to 8 devices.")
flags.DEFINE_integer("rounds", 3, "Interleaved rounds per mesh.")
flags.DEFINE_string("peers_dir", os.path.join(ROOT, "..", "shared", "peers"),
                    "Directory holding tinylm.py, plain_step.py and peer_redco_step.py.")
flags.DEFINE_string("redco_python", "/tmp/redco-venv/bin/python",
                    "Python of an environment with redco==0.4.23 (skipped when missing).")
flags.DEFINE_list("steps", ["jit", "shard_map"], "The engine's train step implementations to time (Trainer(step=)).")
flags.DEFINE_integer("in_process_rounds", 3, "Alternations of the engine's `fit` and the floor's loop inside each "
                     "engine worker (data x model meshes only; 0: none).")
flags.DEFINE_string("worker", None, "Internal: run one engine measurement for this mesh and print it.")
flags.DEFINE_string("worker_step", "jit", "Internal: the step implementation of --worker.")

GLOBAL_BATCH, STEPS, WARMUP, HOST_STEPS = 16, 20, 2, 200


def engine_worker(mesh_text, step_kind):
    """One measurement: prints STEADY <s> (`fit`'s STEPS steps), DIRECT <s> (the same compiled step called STEPS
    times directly on one placed batch: the program alone, without `fit`'s host work), COMPILE <s>, COMPILES <n>,
    HOST <ms> and HOST_FLOOR <ms> (`_host_work`), and on data x model meshes INPROCESS <ratio>
    (`_in_process_ratio`)."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sys.path.insert(0, os.path.abspath(FLAGS.peers_dir))
    from engine import compiler
    compiler.configure()  # the engine's overlap flags (none on CPU), before JAX starts its backend
    import jax
    import numpy as np
    import optax
    from tinylm import TinyLM, collate_fn, make_examples, xent

    import engine
    from engine import data as data_lib
    data, fsdp, model = (int(x) for x in mesh_text.split("x"))
    mesh = engine.make_mesh(data=data, fsdp=fsdp, model=model)
    lm = TinyLM()
    params = lm.init(jax.random.key(0), collate_fn(make_examples(1))["input_ids"])["params"]

    def loss_fn(params, batch, rng, is_training):
        return xent(lm.apply({"params": params}, batch["input_ids"]), batch["labels"])

    trainer = engine.Trainer(mesh=mesh, collate_fn=collate_fn, loss_fn=loss_fn, params=params,
                             optimizer=optax.adamw(1e-3), parallelism=engine.Parallelism(step=step_kind))
    per_device = GLOBAL_BATCH // (data * fsdp)
    start = time.perf_counter()
    trainer.fit(make_examples(GLOBAL_BATCH * WARMUP, 1), per_device_batch_size=per_device, log_every=100)
    jax.block_until_ready(trainer.params)
    compile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    trainer.fit(make_examples(GLOBAL_BATCH * STEPS, 2), per_device_batch_size=per_device, n_epochs=1,
                log_every=100)
    jax.block_until_ready(trainer.params)
    # The floor and RedCoast time STEPS steps: so must the engine (n_epochs=2 here once timed 2 x STEPS, when
    # fit's n_epochs came to count more epochs rather than a lifetime total).
    assert trainer.step == WARMUP + STEPS, (trainer.step, WARMUP + STEPS)
    print(f"STEADY {time.perf_counter() - start:.4f}")
    if fsdp == 1 and FLAGS.in_process_rounds > 0:
        print(f"INPROCESS {_in_process_ratio(trainer, per_device, make_examples):.4f}")
    compiled, params, opt_state = trainer.compiled_step(), trainer.params, trainer.opt_state  # donated: fit is done
    _, _, batch = next(data_lib.iterate_batches(mesh, make_examples(GLOBAL_BATCH, 3), collate_fn,
                                                per_device_batch_size=per_device))
    start = time.perf_counter()
    for i in range(STEPS):
        params, opt_state, _ = compiled(params, opt_state, batch, np.int32(WARMUP + STEPS + i))
    jax.block_until_ready((params, opt_state))
    print(f"DIRECT {time.perf_counter() - start:.4f}")
    print(f"COMPILE {compile_seconds:.4f}")
    print(f"COMPILES {trainer.compile_count}")
    trainer.set_params(params, reset_optimizer=True)  # the direct calls donated the state fit held
    fit_ms, floor_ms = _host_work(trainer, per_device, mesh, collate_fn, make_examples)
    print(f"HOST {fit_ms:.4f}")
    print(f"HOST_FLOOR {floor_ms:.4f}")


def _host_work(trainer, per_device, mesh, collate_fn, make_examples):
    """(ms a step of `fit` around a step that returns the state unchanged, ms a step of the floor's loop without its
    step: collation and `device_put` of each batch onto the data axes)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    metrics = {"loss": jnp.zeros(()), "grad_norm": jnp.zeros(()), "finite": jnp.array(True)}
    trainer._program.executable = lambda sync, *args: (lambda p, o, b, s: (p, o, metrics))  # noqa: SLF001
    examples = make_examples(GLOBAL_BATCH * HOST_STEPS, 4)
    start = time.perf_counter()
    trainer.fit(examples, per_device_batch_size=per_device, n_epochs=1, log_every=100)
    fit_ms = (time.perf_counter() - start) / HOST_STEPS * 1e3
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    start = time.perf_counter()
    for i in range(0, len(examples), GLOBAL_BATCH):
        batch = jax.device_put(collate_fn(examples[i:i + GLOBAL_BATCH]), rows)
    jax.block_until_ready(batch)
    return fit_ms, (time.perf_counter() - start) / HOST_STEPS * 1e3


def _in_process_ratio(trainer, per_device, make_examples):
    """Median over `--in_process_rounds` of (the engine's STEPS steps under `fit`) / (the floor's STEPS steps), the
    two alternated in this process, which runs first swapped every round. The floor is `plain_step.py` run here
    (its own warm-up and timing, output dropped), then its `run` loop called again on the same examples."""
    import jax
    with contextlib.redirect_stdout(io.StringIO()):
        floor = runpy.run_path(os.path.join(os.path.abspath(FLAGS.peers_dir), "plain_step.py"))
    examples = make_examples(GLOBAL_BATCH * STEPS, 2)

    def engine_steps():
        trainer.fit(examples, per_device_batch_size=per_device, n_epochs=1, log_every=100)
        jax.block_until_ready(trainer.params)

    ratios = []
    for i in range(FLAGS.in_process_rounds):
        seconds = {}
        for name, run in (("engine", engine_steps), ("floor", floor["run"]))[::1 if i % 2 == 0 else -1]:
            start = time.perf_counter()
            run(examples) if name == "floor" else run()  # the floor's loop blocks on its parameters at the end
            seconds[name] = time.perf_counter() - start
        ratios.append(seconds["engine"] / seconds["floor"])
    return statistics.median(ratios)


_KEYS = ("STEADY", "DIRECT", "COMPILE", "COMPILES", "INPROCESS", "HOST", "HOST_FLOOR")  # what a worker prints


def _run(cmd, env):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    values = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in _KEYS:
            values[parts[0]] = float(parts[1])
    if "STEADY" not in values:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return values


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def main(argv):
    del argv
    if FLAGS.worker:
        engine_worker(FLAGS.worker, FLAGS.worker_step)
        return
    peers = os.path.abspath(FLAGS.peers_dir)
    have_redco = os.path.exists(FLAGS.redco_python) and os.path.exists(os.path.join(peers, "peer_redco_step.py"))
    rows = []
    for mesh_text in FLAGS.meshes:
        data, fsdp, model = (int(x) for x in mesh_text.split("x"))
        if data * fsdp * model != 8:
            raise app.UsageError(f"--meshes entry {mesh_text!r}: sizes must multiply to 8")
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
                   MP=str(model), PYTHONPATH=ROOT)
        runs = {**{f"engine[{k}]": [] for k in FLAGS.steps}, "floor": [], "redco": []}
        for _ in range(FLAGS.rounds):
            for kind in FLAGS.steps:
                runs[f"engine[{kind}]"].append(_run([sys.executable, __file__, f"--worker={mesh_text}",
                                                     f"--worker_step={kind}", f"--peers_dir={peers}",
                                                     f"--in_process_rounds={FLAGS.in_process_rounds}"], env))
            if fsdp == 1:  # the peers know data x model meshes only
                runs["floor"].append(_run([sys.executable, os.path.join(peers, "plain_step.py")], env))
                if have_redco:
                    runs["redco"].append(_run([FLAGS.redco_python, os.path.join(peers, "peer_redco_step.py")], env))
        med = {k: statistics.median(r["STEADY"] for r in v) if v else float("nan") for k, v in runs.items()}

        def ratio(mine, other):
            if not runs[other]:
                return float("nan")
            return statistics.median(e["STEADY"] / o["STEADY"] for e, o in zip(runs[mine], runs[other]))

        for kind in FLAGS.steps:
            mine = f"engine[{kind}]"
            rows.append((mesh_text, kind, med[mine], med["floor"], med["redco"], ratio(mine, "floor"),
                         ratio(mine, "redco"), statistics.median(r["STEADY"] / r["DIRECT"] for r in runs[mine]),
                         _median(r.get("INPROCESS") for r in runs[mine]),
                         "/".join(f"{_median(r[k] for r in runs[mine]):.2f}" for k in ("HOST", "HOST_FLOOR")),
                         statistics.median(r["COMPILE"] for r in runs[mine]),
                         int(max(r["COMPILES"] for r in runs[mine]))))
    header = ("mesh dxfxm", "step", "engine s", "floor s", "redco s", "engine/floor", "engine/redco", "fit/direct",
              "in-process", "host ms", "compile s", "compiles")
    print(f"{STEPS} steady steps, global batch {GLOBAL_BATCH}, {FLAGS.rounds} interleaved rounds, medians")
    print(" | ".join(f"{h:>12}" for h in header))
    for r in rows:
        print(" | ".join(f"{v:>12.3f}" if isinstance(v, float) else f"{v:>12}" for v in r))


if __name__ == "__main__":
    app.run(main)
