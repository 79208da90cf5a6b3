"""engine.DiLoCo through the Trainer: plain data parallelism as a special case, no collective over `data` outside the
outer step, training and an exact resume."""
import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import engine
from tests import trainer_task as task

EXAMPLES = task.make_examples(64)


def _trainer(mesh, **kwargs):
    return engine.Trainer(mesh=mesh, collate_fn=task.collate_fn, loss_fn=task.loss_fn, params=task.init_params(),
                          **kwargs)


def _max_diff(a, b):
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()), a, b)))


def test_one_inner_sgd_step_with_unit_outer_sgd_is_data_parallel():
    """inner_steps=1, SGD inside and optax.sgd(1.0) outside: the mean of the replicas' SGD steps is the SGD step on
    the mean gradient, so the run equals plain data parallelism (data 4 x model 2)."""
    mesh = engine.make_mesh(data=4, model=2)
    plain = _trainer(mesh, optimizer=optax.sgd(0.5))
    plain.fit(EXAMPLES, per_device_batch_size=2, max_steps=3, log_every=1)
    diloco = _trainer(mesh, optimizer=optax.sgd(0.5),
                      diloco=engine.DiLoCo(inner_steps=1, outer_optimizer=optax.sgd(1.0)))
    diloco.fit(EXAMPLES, per_device_batch_size=2, max_steps=3, log_every=1)
    assert _max_diff(plain.params, diloco.params) < 1e-5
    np.testing.assert_allclose([h["loss"] for h in diloco.history], [h["loss"] for h in plain.history], rtol=1e-5)
    replicas = diloco.opt_state["replicas"]["layers_0"]["down_proj"]["kernel"]
    assert replicas.shape[0] == 4 and replicas.sharding.spec[0] == "data"


def _computations(hlo):
    """{computation name: its instruction lines} of an HLO module's text."""
    comps, name = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            name = header.group(1)
            comps[name] = []
        elif line == "}":
            name = None
        elif name:
            comps[name].append(line)
    return comps


def test_inner_steps_send_nothing_across_data():
    """On a data-only mesh every collective crosses `data`. In the compiled step they all sit in the computations of
    the outer step's conditional branch (run once every inner_steps steps): the inner steps, their gradient norms,
    non-finite guards and metrics are per replica."""
    mesh = engine.make_mesh(data=8)
    trainer = _trainer(mesh, optimizer=optax.adam(1e-2), diloco=engine.DiLoCo(inner_steps=4))
    trainer.fit(EXAMPLES, per_device_batch_size=1, max_steps=1)
    rows = NamedSharding(mesh, P(None, ("data", "fsdp")))
    batch = {k: jax.ShapeDtypeStruct((1, *s), d, sharding=rows) for k, (s, d) in trainer._batch_spec.items()}
    hlo = trainer._compiled_step().lower(trainer.params, trainer.opt_state, batch, np.int32(0)).compile().as_text()
    comps = _computations(hlo)
    branches = [b for line in hlo.splitlines() for b in re.findall(r"branch_computations=\{([^}]*)\}", line)]
    assert len(branches) == 1, branches
    outer, todo = set(), [name.strip().lstrip("%") for name in branches[0].split(",")]
    while todo:  # every computation the branches call, transitively
        name = todo.pop()
        if name not in outer:
            outer.add(name)
            todo += [t for t in re.findall(r"%([\w.\-]+)", " ".join(comps[name])) if t in comps]
    collective = re.compile(r" (all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\(")
    where = [name for name, lines in comps.items() for line in lines if collective.search(line)]
    assert where and set(where) <= outer, (where, outer)


def _diloco_trainer(workdir=None):
    return _trainer(engine.make_mesh(data=4, model=2), optimizer=optax.adam(1e-2), workdir=workdir,
                    diloco=engine.DiLoCo(inner_steps=4))


@pytest.mark.slow
def test_trains_and_the_global_model_moves_at_outer_steps():
    """Adam inside, the paper's outer optimizer: the loss falls; the global params move only at outer steps."""
    trainer = _diloco_trainer()
    start = jax.tree.map(np.asarray, trainer.params)
    trainer.fit(EXAMPLES, per_device_batch_size=2, max_steps=3, log_every=1)
    assert _max_diff(trainer.params, start) == 0.0  # mid-round: the global model has not moved
    trainer.fit(EXAMPLES, per_device_batch_size=2, n_epochs=4, max_steps=16, log_every=1)
    assert _max_diff(trainer.params, start) > 0
    losses = [h["loss"] for h in trainer.history]
    assert np.mean(losses[-4:]) < 0.8 * np.mean(losses[:4]), losses


@pytest.mark.slow
def test_resumes_exactly_between_outer_steps(tmp_path):
    """A run stopped between two outer steps resumes to exactly the uninterrupted run's state (replicas and both
    optimizer states are in the checkpoint)."""
    whole = _diloco_trainer()
    whole.fit(EXAMPLES, per_device_batch_size=2, n_epochs=4, max_steps=10, log_every=1)
    first = _diloco_trainer(str(tmp_path))
    first.fit(EXAMPLES, per_device_batch_size=2, max_steps=6, log_every=1)
    first.close()
    resumed = _diloco_trainer(str(tmp_path))
    assert resumed.step == 6
    resumed.fit(EXAMPLES, per_device_batch_size=2, n_epochs=4, max_steps=10, log_every=1)
    assert _max_diff(resumed.params, whole.params) == 0.0
    assert _max_diff(resumed.opt_state, whole.opt_state) == 0.0
    resumed.close()
    # Without DiLoCo (or on another data size) only the parameters can be taken, and only when asked for.
    other = engine.make_mesh(data=2, model=4)
    with pytest.raises(ValueError, match="holds a checkpoint of a run with DiLoCo with 4 replicas; expected diloco on "
                                         "a mesh with data=4"):
        _trainer(other, optimizer=optax.adam(1e-2), workdir=str(tmp_path))
    plain = _trainer(other, optimizer=optax.adam(1e-2), workdir=str(tmp_path), restore_params_only=True)
    assert plain.step == 10 and _max_diff(plain.params, whole.params) == 0.0


def test_bad_diloco_settings():
    mesh = engine.make_mesh(data=4, model=2)
    with pytest.raises(ValueError, match=r"DiLoCo.inner_steps=0; expected an integer >= 1"):
        engine.DiLoCo(inner_steps=0)
    with pytest.raises(ValueError, match=r"zero_stage=1; expected 0 with diloco"):
        _trainer(mesh, optimizer=optax.sgd(0.1), zero_stage=1, diloco=engine.DiLoCo())
    with pytest.raises(ValueError, match=r"step='shard_map'; expected 'auto' with diloco"):
        _trainer(mesh, optimizer=optax.sgd(0.1), step="shard_map", diloco=engine.DiLoCo())
    with pytest.raises(ValueError, match=r"diloco=4; expected None or an engine.DiLoCo"):
        _trainer(mesh, optimizer=optax.sgd(0.1), diloco=4)
