"""engine.DiLoCo through the Trainer: plain data parallelism as a special case, no collective over `data` outside the
outer step, training and an exact resume."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import engine
import models
from engine import diloco as diloco_lib
from engine import plan as plan_lib
from engine.tasks import lm
from tests import trainer_task as task
from tests.targets import kernel_operands_of_train_step
from tests.test_step import _packed_rows

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
    hlo = trainer.compiled_step().as_text()
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


def _diloco_trainer(workdir=None, **diloco):
    return _trainer(engine.make_mesh(data=4, model=2), optimizer=optax.adam(1e-2), workdir=workdir,
                    diloco=engine.DiLoCo(inner_steps=4, **diloco))


def _whole_and_resumed(workdir, stop, end, **diloco):
    """An uninterrupted run of `end` steps, and one stopped after `stop` steps and resumed to `end`."""
    whole = _diloco_trainer(**diloco)
    whole.fit(EXAMPLES, per_device_batch_size=2, n_epochs=4, max_steps=end, log_every=1)
    first = _diloco_trainer(workdir, **diloco)
    first.fit(EXAMPLES, per_device_batch_size=2, max_steps=stop, log_every=1)
    first.close()
    resumed = _diloco_trainer(workdir, **diloco)
    assert resumed.step == stop
    resumed.fit(EXAMPLES, per_device_batch_size=2, n_epochs=4, max_steps=end, log_every=1)
    return whole, resumed


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
    whole, resumed = _whole_and_resumed(str(tmp_path), 6, 10)
    assert _max_diff(resumed.params, whole.params) == 0.0
    assert _max_diff(resumed.opt_state, whole.opt_state) == 0.0
    resumed.close()
    # Without DiLoCo (or on another data size) only the parameters can be taken, and only when asked for.
    other = engine.make_mesh(data=2, model=4)
    with pytest.raises(ValueError, match="holds a checkpoint of a run with DiLoCo with 4 replicas; expected diloco on "
                                         "a mesh with data=4"):
        _trainer(other, optimizer=optax.adam(1e-2), workdir=str(tmp_path))
    plain = _trainer(other, optimizer=optax.adam(1e-2), workdir=str(tmp_path),
                     checkpointing=engine.Checkpointing(params_only=True))
    assert plain.step == 10 and _max_diff(plain.params, whole.params) == 0.0
    with pytest.raises(ValueError, match=r"holds a checkpoint of a DiLoCo run with fragments=1; expected "
                                         r"DiLoCo\(fragments=1\) \(--diloco_fragments=1\) to resume it"):
        _trainer(engine.make_mesh(data=4, model=2), optimizer=optax.adam(1e-2), workdir=str(tmp_path),
                 diloco=engine.DiLoCo(inner_steps=4, fragments=2))
    # Another overlap would take an outer step due at a checkpoint twice (or never): refused.
    with pytest.raises(ValueError, match=r"holds a checkpoint of a DiLoCo run with overlap=False; expected "
                                         r"DiLoCo\(overlap=False\) \(--diloco_overlap=false\) to resume it"):
        _trainer(engine.make_mesh(data=4, model=2), optimizer=optax.adam(1e-2), workdir=str(tmp_path),
                 diloco=engine.DiLoCo(inner_steps=4, overlap=True))


def test_overlapped_exchange_does_not_wait_for_the_inner_step():
    """overlap=True on a data-only mesh (every collective crosses `data`): the inner-only program has no collective,
    and every collective of the program with the outer step sits in its entry computation (no conditional or loop
    around it), fed by the parameters and replicas, never by the batch, so the compiler may schedule it under the
    inner step's compute."""
    mesh = engine.make_mesh(data=8)
    diloco = engine.DiLoCo(inner_steps=4, fragments=2, overlap=True)
    trainer = _trainer(mesh, optimizer=optax.sgd(0.1), diloco=diloco)
    trainer.fit(EXAMPLES, per_device_batch_size=1, max_steps=1)
    rows = NamedSharding(mesh, P(None, ("data", "fsdp")))
    batch = {k: jax.ShapeDtypeStruct((1, *x.shape), x.dtype, sharding=rows) for k, x in trainer.batch_spec.items()}
    collective = re.compile(r" (all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\(")
    for sync in (False, True):
        hlo = trainer.compile(batch, sync=sync).as_text()
        comps, entry = plan_lib._computations(hlo)
        where = {name for name, lines in comps.items() for line in lines if collective.search(line)}
        assert where == ({entry} if sync else set()), where
        defs = {m.group(1): m for m in map(plan_lib._INSTR.match, comps[entry]) if m}
        batch_params = {n for n, m in defs.items() if m.group(3) == "parameter" and 'op_name="batch[' in m.group(0)}

        def feeds(name):
            seen, todo = set(), [name]
            while todo:
                n = todo.pop()
                if n not in seen and n in defs:
                    seen.add(n)
                    todo += re.findall(r"%([\w.\-]+)", defs[n].group(4).split("), ")[0])
            return seen
        root = next(n for n, m in defs.items() if m.group(0).lstrip().startswith("ROOT"))
        assert len(batch_params) == 2 and feeds(root) & batch_params  # the walk sees the inner step's inputs
        exchanged = [n for n, m in defs.items() if collective.search(m.group(0))]
        assert bool(exchanged) == sync and not any(feeds(n) & batch_params for n in exchanged)


@pytest.mark.slow
def test_streaming_resumes_exactly(tmp_path):
    """fragments=2 with int4 outer gradients, overlapped: stopped after 6 steps (the last one's part falls due) and is
    exchanged by the resumed run's first step (the host picks that program from the step number), the resumed run
    ends on the uninterrupted run's state bit for bit, both parts' outer states included."""
    streaming = dict(fragments=2, outer_dtype="int4", overlap=True)
    assert engine.DiLoCo(inner_steps=4, **streaming).syncs_at(6)
    whole, resumed = _whole_and_resumed(str(tmp_path), 6, 9, **streaming)
    assert _max_diff(resumed.params, whole.params) == 0.0
    assert _max_diff(resumed.opt_state, whole.opt_state) == 0.0
    assert _copies_agree(resumed.params) and _copies_agree(resumed.opt_state)
    resumed.close()


def test_bad_diloco_settings():
    mesh = engine.make_mesh(data=4, model=2)
    with pytest.raises(ValueError, match=r"DiLoCo.inner_steps=0; expected an integer >= 1"):
        engine.DiLoCo(inner_steps=0)
    with pytest.raises(ValueError, match=r"zero_stage=1; expected 0 with diloco"):
        _trainer(mesh, optimizer=optax.sgd(0.1), diloco=engine.DiLoCo(), parallelism=engine.Parallelism(zero_stage=1))
    with pytest.raises(ValueError, match=r"step='shard_map'; expected 'auto' with diloco"):
        _trainer(mesh, optimizer=optax.sgd(0.1), diloco=engine.DiLoCo(),
                 parallelism=engine.Parallelism(step="shard_map"))
    with pytest.raises(ValueError, match=r"diloco=4; expected None or an engine.DiLoCo"):
        _trainer(mesh, optimizer=optax.sgd(0.1), diloco=4)
    with pytest.raises(ValueError, match=r"DiLoCo.fragments=5; expected an integer from 1 to inner_steps=4"):
        engine.DiLoCo(inner_steps=4, fragments=5)
    with pytest.raises(ValueError, match=r"DiLoCo.fragments=0; expected an integer from 1"):
        engine.DiLoCo(fragments=0)
    with pytest.raises(ValueError, match=r"DiLoCo.overlap=1; expected a bool"):
        engine.DiLoCo(overlap=1)
    with pytest.raises(ValueError, match=r"DiLoCo.outer_dtype='fp4'; expected one of \('float32', 'bfloat16', "
                                         r"'int8', 'int4'\)"):
        engine.DiLoCo(outer_dtype="fp4")


def test_fragment_plan_cuts_each_leaf_locally_and_strided():
    """A leaf is cut along its first dim that parts x (devices splitting it) divides: part p of a stacked [L, ...]
    leaf is layers p, p + P, ...; a leaf with no such dim goes whole to the lightest part."""
    dl = diloco_lib
    shapes = {"stack": (4, 6, 8), "split": (6, 8), "odd": (3, 5), "small": (5,)}
    specs = {"stack": P(None, "model"), "split": P("model", None), "odd": P(), "small": P()}
    plan = dl.fragment_plan(engine.DiLoCo(inner_steps=4, fragments=2), shapes, specs, {"data": 4, "model": 2})
    assert plan == {"stack": dl._Cut(dim=0), "split": dl._Cut(dim=1), "odd": dl._Cut(owner=0),
                    "small": dl._Cut(owner=1)}
    tree = {k: jnp.arange(1, np.prod(s) + 1, dtype=jnp.float32).reshape(s) for k, s in shapes.items()}
    for p in range(2):
        part = dl.fragment(tree, plan, p, 2)
        np.testing.assert_array_equal(part["stack"], tree["stack"][p::2])
        np.testing.assert_array_equal(part["split"], tree["split"][:, p::2])
        assert (part["odd"] is None) == (p == 1) and (part["small"] is None) == (p == 0)
        # The step's traced-index take and in-place write-back of the cut leaves (the whole ones stay).
        taken = jax.jit(lambda t, q: dl._take(t, plan, q, 2))(tree, jnp.int32(p))
        assert taken["odd"] is None and taken["small"] is None
        np.testing.assert_array_equal(taken["stack"], part["stack"])
        back = dl._give(tree, plan, p, 2, jax.tree.map(lambda x: -x, taken))
        for k in tree:
            expect = np.zeros(shapes[k], bool)
            if k == "stack":
                expect[p::2] = True
            elif k == "split":
                expect[:, p::2] = True
            np.testing.assert_array_equal(np.asarray(back[k]) != tree[k], expect)


def _reference_rounds(trainer, batches, start, lr):
    """Streaming DiLoCo from the Trainer's state after step `start`, in numpy and optax on one device: every replica
    takes an SGD step on its rows, then each part whose offset `step + 1` reaches takes its outer step (strided
    numpy slices of the Trainer's plan, which the previous test checks)."""
    d = trainer.diloco
    parts, plan = d.fragments, trainer._state.diloco_plan
    glob = jax.tree.map(np.array, trainer.params)
    reps = jax.tree.map(np.array, trainer.opt_state["replicas"])
    states = list(trainer.opt_state["outer"]) if parts > 1 else [trainer.opt_state["outer"]]
    n = jax.tree.leaves(reps)[0].shape[0]

    def view(x, cut, p, lead):
        if cut.dim is None:
            return x if cut.owner == p else None
        return x[(slice(None),) * (cut.dim + lead) + (slice(p, None, parts),)]

    grad_fn = jax.jit(jax.grad(lambda p, rows: task.loss_fn(p, rows, None, True)[0]))

    def outer_step(p, before):
        """Part p's outer update from the replicas `before`; returns the global part's change."""
        g = jax.tree.map(lambda cut, x: view(x, cut, p, 0), plan, glob)
        r = jax.tree.map(lambda cut, x: view(x, cut, p, 1), plan, before)
        updates, states[p] = d.outer_optimizer.update(jax.tree.map(lambda a, b: a - b.mean(0), g, r), states[p], g)
        for a, u in zip(jax.tree.leaves(g), jax.tree.leaves(updates)):
            a += np.asarray(u)  # a view: writes through to glob
        return g

    for step, batch in enumerate(batches, start):
        due = d.syncs_at(step) and d.due_part(step - 1)
        before = jax.tree.map(np.copy, reps)
        rows = batch["input_ids"].shape[1] // n
        for r in range(n):
            mine = {k: v[0, r * rows:(r + 1) * rows] for k, v in batch.items()}
            params = jax.tree.map(lambda x: x[r], reps)
            grads = grad_fn(params, mine)
            for x, g in zip(jax.tree.leaves(reps), jax.tree.leaves(grads)):
                x[r] -= lr * np.asarray(g)
        if d.overlap:  # the part due the step before, from the replicas before this inner step
            if due is not False:
                g = outer_step(due, before)
                r, b = (jax.tree.map(lambda cut, x: view(x, cut, due, 1), plan, t) for t in (reps, before))
                for a, x, y in zip(jax.tree.leaves(g), jax.tree.leaves(r), jax.tree.leaves(b)):
                    x[...] = a + (x - y)  # the new global part plus the inner update made meanwhile
            continue
        p = d.due_part(step)
        if p is not None:
            g = outer_step(p, reps)
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(jax.tree.map(lambda cut, x: view(x, cut, p, 1),
                                                                             plan, reps))):
                b[...] = a
    return glob, reps


def _run_against_reference(outer_dtype, overlap=False):
    """(max |compiled - reference| of the global params, of the replicas, max |reference change|) over six steps
    of fragments=2, inner_steps=4 (offsets 2 and 0; the paper's Nesterov outer optimizer, SGD inside)."""
    mesh = engine.make_mesh(data=4, model=2)
    diloco = engine.DiLoCo(inner_steps=4, fragments=2, outer_dtype=outer_dtype, overlap=overlap)
    trainer = _trainer(mesh, optimizer=optax.sgd(0.5), diloco=diloco)
    trainer.fit(EXAMPLES, per_device_batch_size=2, max_steps=1)
    assert diloco.offsets() == [2, 0] and len(trainer.opt_state["outer"]) == 2
    start = jax.tree.map(np.array, trainer.params)
    batches = [{k: v[None] for k, v in task.collate_fn(EXAMPLES[8 * i:8 * i + 8]).items()} for i in range(1, 7)]
    want_params, want_reps = _reference_rounds(trainer, batches, 1, 0.5)
    rows = NamedSharding(mesh, P(None, ("data", "fsdp")))
    params, opt_state = trainer.params, trainer.opt_state
    for step, batch in enumerate(batches, 1):
        step_fn = trainer._program.jitted(diloco.syncs_at(step))
        params, opt_state, _ = step_fn(params, opt_state, jax.device_put(batch, rows), np.int32(step))
    return _max_diff(params, want_params), _max_diff(opt_state["replicas"], want_reps), _max_diff(want_params, start)


@pytest.mark.parametrize("overlap", [False, True])
def test_streaming_fragments_match_a_reference(overlap):
    """Streaming DiLoCo's parts take their outer steps in turn, each with its own outer state: the compiled step
    equals the numpy reference; with overlap, each part's outer step lands a step later, exchanged from the
    replicas before that step's inner update, which the replicas keep."""
    params_error, replicas_error, moved = _run_against_reference("float32", overlap)
    assert params_error < 1e-5 and replicas_error < 1e-5 and moved > 0.1


@pytest.mark.slow
@pytest.mark.parametrize("outer_dtype, levels", [("bfloat16", 256), ("int8", 127), ("int4", 7)])
def test_quantized_outer_gradients_stay_within_their_step(outer_dtype, levels):
    """Quantized outer gradients land off the fp32 reference, by less than 2 / (levels of the format) of how far
    the reference moved (measured: bf16 0.0006, int8 0.0018, int4 0.031 of a 0.19 move: the error follows the
    step size of each format)."""
    params_error, _, moved = _run_against_reference(outer_dtype)
    assert 0 < params_error < 2 / levels * moved


def _copies_agree(tree):
    """Every device's copy of every block of every leaf is the same (a leaf replicated over `model` must not
    round differently on the devices that hold it)."""
    for x in jax.tree.leaves(tree):
        blocks = {}
        for shard in x.addressable_shards:
            blocks.setdefault(str(shard.index), []).append(np.asarray(shard.data))
        if any(np.any(b != copies[0]) for copies in blocks.values() for b in copies):
            return False
    return True


def _outer_branch_bytes(diloco, mesh):
    trainer = _trainer(mesh, optimizer=optax.sgd(0.1), diloco=diloco)
    trainer.fit(EXAMPLES, per_device_batch_size=1, max_steps=1)
    hlo = trainer.compiled_step().as_text()
    (branches,) = plan_lib.conditional_branches(hlo)
    sizes = [plan_lib.collective_bytes(hlo, mesh.size, root=b) for b in branches]
    parts = [[x.size for x in jax.tree.leaves(diloco_lib.fragment(trainer.params, trainer._state.diloco_plan, p,
                                                                   diloco.fragments))]
             for p in range(diloco.fragments)]
    return sizes, parts


@pytest.mark.parametrize("outer_dtype, payload", [pytest.param("float32", None, marks=pytest.mark.slow),
                                                   ("int4", 0.5)])
def test_outer_steps_send_a_part_each_in_the_wire_format(outer_dtype, payload):
    """8 replicas, fragments=2: the conditional has a branch without collectives and one per part, each sending
    only its part; in fp32 an all-reduce (2 x 7/8 x 4 bytes a value), quantized an all-to-all of every replica's
    delta and an all-gather of the mean (2 x 7/8 x (payload + 4 / 256) bytes a value, each leaf padded to 8 x 256
    values)."""
    mesh = engine.make_mesh(data=8)
    sizes, parts = _outer_branch_bytes(engine.DiLoCo(inner_steps=4, fragments=2, outer_dtype=outer_dtype), mesh)
    assert len(sizes) == 3 and sum(sizes[0].values()) == 0
    assert abs(sum(parts[0]) - sum(parts[1])) < 0.1 * sum(map(sum, parts))
    for got, leaves in zip(sizes[1:], parts):
        if payload is None:
            assert got["all-reduce"] == int(2 * 7 / 8 * 4 * sum(leaves)) and sum(got.values()) == got["all-reduce"]
        else:
            padded = sum(-(-n // (8 * 256)) * 8 * 256 for n in leaves)
            per = int(7 / 8 * padded * (payload + 4 / 256))
            assert abs(got["all-to-all"] - per) <= 8 and abs(got["all-gather"] - per) <= 8, (got, per)
            assert sum(got.values()) == got["all-to-all"] + got["all-gather"]


def _llama_diloco(mesh, params=None, **options):
    model = models.create_model("llama", "tiny", scan_layers=True, remat="full", **options)
    params = models.init_params(model, jax.random.PRNGKey(0)) if params is None else params
    loss = lm.lm_loss_fn(model, options.get("mlp_implementation"), interpret=options.get("kernel_interpret", False))
    return engine.Trainer(mesh=mesh, collate_fn=lm.collate_lm, loss_fn=loss, params=params,
                          optimizer=optax.adam(1e-2), diloco=engine.DiLoCo(inner_steps=2))


def test_step_lowered_for_cuda_runs_each_replicas_kernels_on_its_rows():
    """DiLoCo's replicas are a vmap over `data`: inside it the kernels must not split rows over `data` (JAX refuses
    a vmap's spmd axis in a shard_map's specs; until stop 23 every Pallas kernel under DiLoCo failed so, i.e. DiLoCo
    on any GPU). Lowered for cuda on data 2 x model 2, a Triton LLaMA's attention, gated MLP and fused loss kernels
    see one replica's rows on its own devices: 2 rows (4 / data 2) x 32 tokens, half the heads and hidden columns
    (whole rows would be 4)."""
    model_kernels = dict(attention_implementation="triton", mlp_implementation="triton")
    model = models.create_model("llama", "tiny", scan_layers=True, remat="full", **model_kernels)
    trainer = _llama_diloco(engine.make_mesh(data=2, model=2, devices=jax.devices()[:4]),
                            params=jax.eval_shape(lambda: models.init_params(model, jax.random.PRNGKey(0))),
                            **model_kernels)
    operands = kernel_operands_of_train_step(trainer, 4, 32)
    attention = [t for t in operands if re.search(r"tensor<\d+x32x\d+x16x", t)]
    # q: 2 of the 4 heads; k, v: 1 of the 2 kv heads.
    assert attention and all(set(re.findall(r"tensor<(\d+x\d+x\d+x16)x", t)) == {"2x32x2x16", "2x32x1x16"}
                             for t in attention), attention
    mlp = [t for t in operands if t.startswith("tensor<64x64xf32>, tensor<64x64xf32>")]  # gate and up halves
    assert mlp and not [t for t in operands if t.startswith("tensor<128x64xf32>")], operands  # 2 x 32 token rows


@pytest.mark.slow  # CI time (~25 s: interpreted kernels); the lowering above runs by default
def test_pallas_kernels_and_context_parallelism_inside_the_replicas():
    """DiLoCo with interpreted Triton kernels (attention, gated MLP, fused loss) trains like DiLoCo on 'xla'; on
    data 2 x context 2 x model 2 (each replica's rows split over context) like data 2 x model 2."""
    rows, four = _packed_rows(16, seq=32), jax.devices()[:4]

    def losses(mesh, **options):
        trainer = _llama_diloco(mesh, **options)
        trainer.fit(rows, per_device_batch_size=2, max_steps=3, log_every=1)
        return [h["loss"] for h in trainer.history]

    want = losses(engine.make_mesh(data=2, model=2, devices=four))
    got = losses(engine.make_mesh(data=2, model=2, devices=four), attention_implementation="triton",
                 mlp_implementation="triton", kernel_interpret=True)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(losses(engine.make_mesh(data=2, context=2, model=2)), want, rtol=1e-5)
