"""engine.step.shard_map_train_step against the reference jit_train_step on the 8 simulated devices."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import engine
import kernels
import models
from engine import step as step_lib
from engine.step import collectives, gathering, layer_scan
from engine.tasks import lm
from tests import trainer_task as task

EXAMPLES = task.make_examples(64)
MESHES = {"8x1x1": dict(data=8), "1x8x1": dict(data=1, fsdp=8), "2x2x2": dict(data=2, fsdp=2, model=2),
          "1x4x2": dict(data=1, fsdp=4, model=2)}


def _fit(kind, mesh, steps=5, accumulate_grad_batches=1, **parallelism):
    trainer = engine.Trainer(mesh=engine.make_mesh(**MESHES[mesh]), collate_fn=task.collate_fn, loss_fn=task.loss_fn,
                             params=task.init_params(), optimizer=optax.sgd(0.1, momentum=0.9),
                             accumulate_grad_batches=accumulate_grad_batches,
                             parallelism=engine.Parallelism(step=kind, **parallelism))
    trainer.fit(EXAMPLES, per_device_batch_size=1, max_steps=steps, log_every=steps)
    return trainer


def _assert_same_run(ref, got, rel=1e-5):
    """Every metric of every step equal to fp32 rounding; each parameter within `rel` of its largest entry (or of
    1e-3 for a parameter that stays at rounding level, like an attention key bias, whose gradient is zero in exact
    arithmetic: softmax ignores a shift shared by a query's logits)."""
    assert len(ref.history) == len(got.history)
    for a, b in zip(ref.history, got.history):
        assert a.keys() == b.keys(), (a, b)
        for k in a:
            np.testing.assert_allclose(b[k], a[k], rtol=rel, atol=1e-6, err_msg=f"{k} at step {a['step']}")
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(jax.device_get(ref.params))[0],
                            jax.tree.leaves(jax.device_get(got.params))):
        err = np.abs(np.asarray(x) - np.asarray(y)).max() / max(np.abs(np.asarray(x)).max(), 1e-3)
        assert err <= rel, (jax.tree_util.keystr(path), err)


# SGD with momentum: Adam divides by sqrt(v), which magnifies rounding in near-zero gradients past 1e-5.
# Each mesh once by default, with a different accumulation / ZeRO combination each; the full cross product is slow.
FAST = [("1x8x1", 2, 2), ("2x2x2", 2, 1)]  # (8x1x1, 1x4x2: slow, for CI time; 2x2x2 has fsdp, model and data)
SLOW = [(m, a, z) for m in MESHES for a in (1, 2) for z in (0, 1, 2) if (m, a, z) not in FAST]


@pytest.mark.parametrize("mesh,accumulate,zero_stage",
                         FAST + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW])
def test_shard_map_step_equals_jit_step(mesh, accumulate, zero_stage):
    kwargs = dict(accumulate_grad_batches=accumulate, zero_stage=zero_stage)
    ref, got = _fit("jit", mesh, **kwargs), _fit("shard_map", mesh, **kwargs)
    _assert_same_run(ref, got)
    assert got.compile_count == 1


def _llama_trainer(kind, mesh, loss_fn, remat="full", **kwargs):
    model = models.FAMILIES["llama"].Model(models.get_config("llama", "tiny", scan_layers=True, remat=remat))
    params = models.init_params(model, jax.random.PRNGKey(0))
    return engine.Trainer(mesh=engine.make_mesh(**MESHES[mesh]), collate_fn=lm.collate_lm, loss_fn=loss_fn(model),
                          params=params, optimizer=optax.sgd(0.5), **kwargs, parallelism=engine.Parallelism(step=kind))


def _packed_rows(n, seq=16, seed=0):
    """Rows with two documents and some padding: the labelled-token count differs from row to row."""
    rng = np.random.RandomState(seed)
    rows = []
    for i in range(n):
        seg = np.ones(seq + 1, np.int32)
        seg[rng.randint(2, seq):] = 2
        if i % 3 == 0:
            seg[-rng.randint(1, 6):] = 0
        rows.append({"tokens": rng.randint(0, 120, seq + 1).astype(np.int32), "segment_ids": seg})
    return rows


def test_scanned_llama_token_weighted_loss_and_per_layer_gathers():
    """LLaMA with scan-over-layers and remat on a 1x4x2 mesh: with `weight_metric='tokens'` the token-weighted loss,
    metrics and updates equal the reference's; every ZeRO-3 gather inside the layer loop is one layer's weight."""
    def weighted(model):
        fn = lm.lm_loss_fn(model)
        fn.weight_metric = "tokens"
        return fn

    rows = _packed_rows(32)
    ref = _llama_trainer("jit", "1x4x2", lm.lm_loss_fn, accumulate_grad_batches=2)
    ref.fit(rows, per_device_batch_size=1, max_steps=3, log_every=3)
    got = _llama_trainer("shard_map", "1x4x2", weighted, accumulate_grad_batches=2)
    got.fit(rows, per_device_batch_size=1, max_steps=3, log_every=3)
    _assert_same_run(ref, got)
    assert got.history[-1]["tokens"] == ref.history[-1]["tokens"]  # the weight metric is a global count

    hlo = got.compiled_step().as_text()  # the program fit ran
    stacked = {tuple(x.shape) for x in jax.tree.leaves(got.params["layers"])}
    gathered = [tuple(int(d) for d in m.split(",")) for m in re.findall(r"= \w+\[([\d,]+)\][^ ]* all-gather\(", hlo)]
    assert gathered and not stacked & set(gathered), (stacked, gathered)
    per_layer = {s[1:] for s in stacked}
    assert sum(g in per_layer for g in gathered) >= 2 * 7  # 7 layer matrices, gathered forward and in backward


def test_a_scanned_stack_without_remat_gathers_each_layer_again_in_the_backward():
    """A scanned LLaMA without remat on 1x4x2, whose layer keeps only its matmul and kernel outputs
    (`models.layers.stack`'s policy): the shard_map step's update equals the jit step's, and each layer matrix is
    gathered in the forward and again in the backward pass (none kept from one to the other, none stacked)."""
    rows = _packed_rows(16)
    ref = _llama_trainer("jit", "1x4x2", lm.lm_loss_fn, remat="none")
    ref.fit(rows, per_device_batch_size=1, max_steps=2, log_every=2)
    got = _llama_trainer("shard_map", "1x4x2", lm.lm_loss_fn, remat="none")
    got.fit(rows, per_device_batch_size=1, max_steps=2, log_every=2)
    _assert_same_run(ref, got)
    hlo = got.compiled_step().as_text()
    stacked = {tuple(x.shape) for x in jax.tree.leaves(got.params["layers"])}
    gathered = [tuple(int(d) for d in m.split(",")) for m in re.findall(r"= \w+\[([\d,]+)\][^ ]* all-gather\(", hlo)]
    assert gathered and not stacked & set(gathered), (stacked, gathered)
    # 7 layer matrices (each device's `model` block of them), gathered in the forward and the backward pass
    assert sum(len(g) == 2 for g in gathered) >= 2 * 7, gathered


@pytest.mark.slow
def test_dropout_masks_survive_the_pipelined_stack():
    """With dropout, the hand-pipelined layer stack, which recomputes each layer in the backward pass, gives the
    updates of the plain per-layer gather: the recomputation draws the forward's masks, hidden and attention ones.
    (And dropout is on: the same run without it differs.)"""
    def run(dropout_rate, pipelined=True):
        model = models.create_model("llama", "tiny", scan_layers=True, remat="full", num_layers=3,
                                    intermediate_size=96, dropout_rate=dropout_rate,
                                    attention_dropout_rate=dropout_rate)
        real = layer_scan.is_remat_layer_stack
        if not pipelined:
            layer_scan.is_remat_layer_stack = lambda *a: False
        try:
            trainer = engine.Trainer(mesh=engine.make_mesh(**MESHES["1x8x1"]), collate_fn=lm.collate_lm,
                                     loss_fn=lm.lm_loss_fn(model), params=models.init_params(
                                         model, jax.random.PRNGKey(1)), optimizer=optax.sgd(0.5),
                                         parallelism=engine.Parallelism(step="shard_map"))
            trainer.fit(_packed_rows(32, seed=1), per_device_batch_size=1, max_steps=3, log_every=3)
        finally:
            layer_scan.is_remat_layer_stack = real
        return trainer

    pipelined = run(0.2)
    _assert_same_run(run(0.2, pipelined=False), pipelined)
    without = run(0.0)
    assert not np.allclose(without.history[-1]["loss"], pipelined.history[-1]["loss"], rtol=1e-3)


@pytest.mark.parametrize("family,mesh,layers", [("llama", "1x8x1", 3),
                                               pytest.param("opt", "1x8x1", 3, marks=pytest.mark.slow),
                                               pytest.param("llama", "2x2x2", 4, marks=pytest.mark.slow)])
def test_pipelined_layer_stack_and_vocab_parallel_lookup(family, mesh, layers):
    """A remat'd scan-over-layers model runs the hand-pipelined layer stack (gather of layer t+1 and reduce-scatter
    of layer t+1's gradient beside layer t; the first and last iterations peeled) and, where the embedding table is
    split by rows (1x8x1), the vocab-parallel lookup: the updates equal the reference step's. LLaMA's table is never
    all-gathered and its layer matrices are gathered one layer at a time, on 2x2x2 each device's `model` block of them
    (the exact bytes: tests/test_plan.py); OPT ties its table to the output projection (looked up vocab-parallel,
    gathered for the head) and has biases. LLaMA uses the fused head + loss, which on 1x8x1 runs vocab-parallel too:
    neither its table nor its head is gathered."""
    sizes = dict(intermediate_size=96) if family == "llama" else dict(ffn_dim=96)
    model = models.create_model(family, "tiny", scan_layers=True, remat="full", num_layers=layers, **sizes)
    params = models.init_params(model, jax.random.PRNGKey(1))
    calls, lookups, heads = [], [], []
    real, real_lookup, real_head = (layer_scan.pipelined_scan, gathering._vocab_parallel_lookup,
                                    kernels.matmul.VocabParallelLoss.run)
    layer_scan.pipelined_scan = lambda *a: calls.append(1) or real(*a)
    gathering._vocab_parallel_lookup = lambda *a: lookups.append(1) or real_lookup(*a)
    kernels.matmul.VocabParallelLoss.run = lambda *a: heads.append(1) or real_head(*a)
    try:
        runs = []
        for kind in ("jit", "shard_map"):
            loss = lm.lm_loss_fn(model, "xla" if family == "llama" else None)
            loss.weight_metric = "tokens"
            trainer = engine.Trainer(mesh=engine.make_mesh(**MESHES[mesh]), collate_fn=lm.collate_lm, loss_fn=loss,
                                     params=params, optimizer=optax.sgd(0.5), accumulate_grad_batches=2,
                                     parallelism=engine.Parallelism(step=kind))
            # 10 tokens per row: the gathered group rows [8 x 10, 64] differ from every weight's shape.
            trainer.fit(_packed_rows(32, seq=10, seed=1), per_device_batch_size=1, max_steps=3, log_every=3)
            runs.append(trainer)
    finally:
        layer_scan.pipelined_scan, gathering._vocab_parallel_lookup = real, real_lookup
        kernels.matmul.VocabParallelLoss.run = real_head
    assert calls and bool(lookups) == (mesh == "1x8x1") and bool(heads) == (mesh == "1x8x1" and family == "llama")
    _assert_same_run(*runs)
    if family != "llama":
        return
    got = runs[1]
    hlo = got.compiled_step().as_text()
    gathered = [tuple(int(d) for d in m.split(",")) for m in re.findall(r"= \w+\[([\d,]+)\][^ ]* all-gather\(", hlo)]
    if mesh == "1x8x1":
        assert (128, 64) not in gathered and (64, 128) not in gathered  # the embedding table, the head
    stacked = {tuple(x.shape) for x in jax.tree.leaves(got.params["layers"])}
    assert not stacked & set(gathered)
    if mesh == "1x8x1":
        assert {(64, 64), (96, 64), (64, 96)} <= set(gathered)
    else:  # each device's model block of q, o, gate / up and down (collectives.in_model_blocks), never the whole
        assert {(64, 32), (32, 64), (64, 48), (48, 64)} <= set(gathered) and not {(96, 64), (64, 96)} & set(gathered)


def _dataflow(lines, comps):
    """{instruction: (opcode, operand names, is a matmul)} of one HLO computation's text lines."""
    out = {}
    for line in lines:
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*? ([a-z][\w\-]*)\((.*?)\)(?:,|$)", line)
        if not m:
            continue
        called = re.search(r"\bcalls=%([\w.\-]+)", line)
        body = "\n".join(comps.get(called.group(1), ())) if called else ""
        matmul = m.group(2) in ("dot", "convolution") or " dot(" in body or " convolution(" in body
        out[m.group(1)] = (m.group(2), re.findall(r"%([\w.\-]+)", m.group(3)), matmul)
    return out


def _derived(flow, seeds):
    """Instructions that depend (transitively, inside the computation) on any of `seeds`."""
    found, changed = set(seeds), True
    while changed:
        changed = False
        for name, (_, operands, _) in flow.items():
            if name not in found and any(o in found for o in operands):
                found.add(name)
                changed = True
    return found


def _ancestors(flow, name):
    """Instructions `name` depends on (transitively, inside the computation)."""
    found, todo = set(), list(flow[name][1])
    while todo:
        n = todo.pop()
        if n in flow and n not in found:
            found.add(n)
            todo.extend(flow[n][1])
    return found


def test_layer_loop_bodies_are_double_buffered():
    """In the compiled step of a 6-layer remat'd LLaMA on 1x8x1, inside each layer loop body every all-gather and
    reduce-scatter has matmuls beside it, neither feeding it nor reading it: each collective is independent of
    compute the scheduler can overlap it with. (The loops run two layers an iteration: a layer's weights gathered
    while the layer before it computes, its gradient reduce-scattered while the layer after it does.)"""
    from engine import plan
    model = models.create_model("llama", "tiny", scan_layers=True, remat="full", num_layers=6, intermediate_size=96)
    params = jax.eval_shape(lambda: models.init_params(model, jax.random.PRNGKey(0)))
    loss = lm.lm_loss_fn(model)
    loss.weight_metric = "tokens"
    trainer = engine.Trainer(mesh=engine.make_mesh(data=1, fsdp=8), collate_fn=lm.collate_lm, loss_fn=loss,
                             params=params, optimizer=optax.sgd(0.1), parallelism=engine.Parallelism(step="shard_map"))
    batch = {k: jax.ShapeDtypeStruct((1, 8, 16), jnp.int32) for k in ("input_ids", "labels", "segment_ids")}
    hlo = plan.compile_step(trainer, batch).as_text()
    comps, entry = plan._computations(hlo)
    kinds = []
    for name, lines in comps.items():
        if name == entry:
            continue
        flow = _dataflow(lines, comps)
        gathers = [n for n, (op, _, _) in flow.items() if op.startswith("all-gather")]
        scatters = [n for n, (op, _, _) in flow.items() if op.startswith("reduce-scatter")]
        if not gathers:
            continue
        kinds.append("backward" if scatters else "forward")
        matmuls = {n for n, (_, _, matmul) in flow.items() if matmul}
        for n in gathers + scatters:
            beside = matmuls - _derived(flow, [n]) - _ancestors(flow, n)
            assert beside, (name, n, "every matmul of the iteration feeds it or reads it")
    assert sorted(kinds) == ["backward", "forward"], kinds


def _scan_task(layers, reverse):
    """A hand-written remat'd scan that uses every input kind `_pipelined_scan` handles: stacked ZeRO-3 weights, a
    float const with a gradient (`c`), an int const (positions), a plain float per-layer input with a gradient
    (`s`, sliced from `c`), per-layer outputs (`ys`) that reach the loss, and either scan direction."""
    def loss_fn(params, batch, rng, is_training):
        x = params["emb"][batch["input_ids"]]  # [B, T, 32]
        pos = jnp.arange(x.shape[1], dtype=jnp.int32)

        def body(h, inputs):
            w, s = inputs
            h = jnp.tanh(h @ w * s + params["c"]) + 0.01 * pos[:, None].astype(h.dtype)
            return h, jnp.mean(h * h)

        h, ys = jax.lax.scan(jax.checkpoint(body), x, (params["w"], params["c"][:layers] + 1.0), reverse=reverse)
        logits = h @ params["emb"].T
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
        return loss + 0.1 * jnp.sum(ys * jnp.arange(1, layers + 1))

    keys = jax.random.split(jax.random.key(layers), 3)
    params = {"w": jax.random.normal(keys[0], (layers, 32, 32)) / 6, "c": jax.random.normal(keys[1], (32,)) * 0.1,
              "emb": jax.random.normal(keys[2], (64, 32)) * 0.3}
    return loss_fn, params


@pytest.mark.parametrize("layers,reverse,loops", [(1, False, "pairs"), (2, True, "pairs"), (3, False, "pairs"),
                                                  (4, True, "pairs"), (5, True, "pairs"), (6, False, "pairs"),
                                                  (3, True, "tpu"), (4, False, "tpu")])
def test_pipelined_scan_equals_plain_autodiff(layers, reverse, loops, monkeypatch):
    """The hand-pipelined stack against XLA's autodiff of the plain scan, with the loops of two layers an iteration
    (GPU, CPU) and with those of one that a TPU program takes (`layer_scan._by_platform`), at 1-6 layers."""
    if loops == "tpu":
        monkeypatch.setattr(layer_scan, "_by_platform", lambda *args, tpu, default: tpu(*args))
    loss_fn, params = _scan_task(layers, reverse)
    calls = []
    real = layer_scan.pipelined_scan
    layer_scan.pipelined_scan = lambda *a: calls.append(1) or real(*a)
    try:
        runs = []
        for kind in ("jit", "shard_map"):
            trainer = engine.Trainer(mesh=engine.make_mesh(data=2, fsdp=4), collate_fn=task.collate_fn,
                                     loss_fn=loss_fn, params=params, optimizer=optax.sgd(0.3, momentum=0.9),
                                     parallelism=engine.Parallelism(step=kind))
            trainer.fit(EXAMPLES, per_device_batch_size=1, max_steps=3, log_every=3)
            runs.append(trainer)
    finally:
        layer_scan.pipelined_scan = real
    assert calls
    _assert_same_run(*runs)


def test_fsdp_collectives_of_model_split_weights_run_on_each_model_block():
    """The ZeRO-3 all-gathers and reduce-scatters of a weight split over `model` too run on each device's `model`
    block (collectives.in_model_blocks), so that `model` 2 halves what each device sends over `fsdp`: the tiny scanned
    LLaMA's compiled shard_map step (remat='full', the pipelined layer stack) on fsdp 2 x model 2 against fsdp 2
    alone. Measured: fsdp 2 alone 164,608 B all-gathered and 180,224 B reduce-scattered; beside model 2, left to the
    partitioner (which gathered the `model` dim around the fsdp collectives) 348,160 and 180,224 (1.53x fsdp
    alone's sum), block by block 81,920 and 90,112 (0.50x)."""
    from engine.tasks import planning
    sent = {}
    for mesh, devices in (("1,2,1", 2), ("1,2,2", 4)):
        plan = planning.plan(model="llama", model_config="tiny", num_devices=devices, mesh=mesh,
                             per_device_batch_size=1, seq_len=64, step="shard_map")
        sent[mesh] = plan["collective_bytes"]["all-gather"] + plan["collective_bytes"]["reduce-scatter"]
    assert 0 < sent["1,2,2"] <= 0.55 * sent["1,2,1"], sent


def test_bf16_gradient_reductions_lower_to_bf16_collectives():
    """reduce_dtype=bf16: every reduce-scatter of the lowered step is bf16 (fp32 by default). Lowered only: the XLA
    CPU compiler of jaxlib 0.10.2 aborts on bf16 reductions inside this step (AllReducePromotion), GPU/TPU do not."""
    mesh = engine.make_mesh(data=2, fsdp=4)
    params = task.init_params()
    specs = engine.auto_shard(params, mesh)
    kwargs = dict(loss_fn=task.loss_fn, optimizer=optax.sgd(0.1), mesh=mesh, param_specs=specs, update_specs=specs,
                  zero_stage=0, accumulate=1, compute_dtype=jnp.bfloat16, remat=False, key=jax.random.key(0))
    batch = {k: v[None] for k, v in task.collate_fn(EXAMPLES[:8]).items()}
    for dtype, name in ((jnp.float32, "f32"), (jnp.bfloat16, "bf16")):
        fn = jax.jit(step_lib.shard_map_train_step(reduce_dtype=dtype, **kwargs))
        lowered = fn.lower(params, optax.sgd(0.1).init(params), batch, np.int32(0)).as_text()
        kinds = set(re.findall(r"stablehlo.reduce_scatter.*?\}\) : \(tensor<[\dx]+x(bf16|f32)>", lowered, re.S))
        assert kinds == {name}, kinds


@pytest.mark.parametrize("mesh", ["1x8x1", pytest.param("2x2x2", marks=pytest.mark.slow)])
def test_bf16_gradients_are_held_in_bf16_and_differ_by_their_rounding(mesh):
    """Precision(grad_dtype=bf16) on a remat'd scan-over-layers LLaMA: the hand-pipelined layer stack keeps its
    gradient buffers in bf16 (the compiled shard_map step holds bf16 arrays of the local weight stacks' shapes; the
    model computes in fp32 here, so nothing else is bf16), and one SGD step of either step differs from the fp32
    gradients' step by at most the rounding of the gradients to bf16 (2^-8 of the largest of each leaf's gradient on
    1x8x1, where the fsdp sum is rounded once; twice that where each of data's two partial sums is rounded, 2x2x2),
    and does differ."""
    model = models.create_model("llama", "tiny", scan_layers=True, remat="full", num_layers=3, intermediate_size=96)
    params = models.init_params(model, jax.random.PRNGKey(1))
    lr = 0.5

    def run(kind, grad_dtype):
        loss = lm.lm_loss_fn(model, "xla")
        loss.weight_metric = "tokens"
        trainer = engine.Trainer(mesh=engine.make_mesh(**MESHES[mesh]), collate_fn=lm.collate_lm, loss_fn=loss,
                                 params=params, optimizer=optax.sgd(lr), precision=engine.Precision(
                                     grad_dtype=grad_dtype), parallelism=engine.Parallelism(step=kind))
        trainer.fit(_packed_rows(16, seq=10, seed=1), per_device_batch_size=1, max_steps=1, log_every=1)
        return trainer

    exact = run("jit", None)
    grads = jax.tree.map(lambda a, b: (np.asarray(a) - np.asarray(b)) / lr, params, jax.device_get(exact.params))
    bound = 2.0 ** -8 * (1 if mesh == "1x8x1" else 2)
    for kind in ("jit", "shard_map"):
        got = run(kind, jnp.bfloat16)
        diffs = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)), jax.device_get(exact.params),
                             jax.device_get(got.params))
        for (path, d), g in zip(jax.tree_util.tree_flatten_with_path(diffs)[0], jax.tree.leaves(grads)):
            assert d.max() <= lr * bound * np.abs(g).max() * 1.01 + 1e-7, (kind, jax.tree_util.keystr(path))
        assert max(d.max() for d in jax.tree.leaves(diffs)) > 0, kind
    stacked = {tuple(x.addressable_shards[0].data.shape) for x in jax.tree.leaves(got.params["layers"]) if x.ndim == 3}
    held = lambda trainer, dt: {tuple(int(d) for d in m.split(","))  # noqa: E731
                                for m in re.findall(dt + r"\[([\d,]+)\]", trainer.compiled_step().as_text())}
    assert stacked <= held(got, "bf16"), (stacked, held(got, "bf16"))


def test_bad_input_errors():
    for name in ("grad_dtype", "reduce_dtype"):
        with pytest.raises(ValueError, match=name + r"=.*float16.*; expected None, jnp.float32 or jnp.bfloat16"):
            engine.Precision(**{name: jnp.float16})
    for step in ("auto", "shard_map"):  # bf16 reductions: GPU / TPU only (the XLA CPU compiler aborts on them)
        with pytest.raises(ValueError, match=r"reduce_dtype=.*bfloat16.*; expected None with the \w+ step on cpu"):
            engine.Trainer(mesh=engine.make_mesh(fsdp=8), collate_fn=task.collate_fn, loss_fn=task.loss_fn,
                           params=task.init_params(), optimizer=optax.sgd(0.1),
                           precision=engine.Precision(reduce_dtype=jnp.bfloat16),
                           parallelism=engine.Parallelism(step=step))
    with pytest.raises(ValueError, match=r"step='pmap'; expected one of \('auto', 'shard_map', 'jit'\)"):
        engine.Trainer(mesh=engine.make_mesh(data=8), collate_fn=task.collate_fn, loss_fn=task.loss_fn,
                       params=task.init_params(), optimizer=optax.sgd(0.1), parallelism=engine.Parallelism(step="pmap"))
    mesh = engine.make_mesh(data=8)
    with pytest.raises(ValueError, match=r"reduce_dtype=.*float16.*; expected jnp.float32 or jnp.bfloat16"):
        step_lib.shard_map_train_step(loss_fn=task.loss_fn, optimizer=optax.sgd(0.1), mesh=mesh, param_specs={},
                                      update_specs={}, zero_stage=0, accumulate=1, compute_dtype=None, remat=False,
                                      key=jax.random.key(0), reduce_dtype=jnp.float16)


@pytest.mark.slow
def test_frozen_weights_in_the_pipelined_stack_get_no_gradient_or_reduction():
    """Frozen stacked weights (`trainable=`) inside the hand-pipelined layer stack: the run equals the reference step
    with the same frozen set, and the compiled step reduce-scatters only the trained weights' gradients (while the
    fully trained model reduce-scatters the MLP's too)."""
    model = models.create_model("llama", "tiny", scan_layers=True, remat="full", intermediate_size=96)
    params = models.init_params(model, jax.random.PRNGKey(1))
    trained = r"layers/attn/(q|v)/|lm_head"
    runs = []
    for kind, trainable in (("jit", trained), ("shard_map", trained), ("shard_map", None)):
        calls = []
        real = layer_scan.pipelined_scan
        layer_scan.pipelined_scan = lambda *a: calls.append(1) or real(*a)
        try:
            loss = lm.lm_loss_fn(model)
            loss.weight_metric = "tokens"
            trainer = engine.Trainer(mesh=engine.make_mesh(**MESHES["1x8x1"]), collate_fn=lm.collate_lm,
                                     loss_fn=loss, params=params, optimizer=optax.sgd(0.5), trainable=trainable,
                                     parallelism=engine.Parallelism(step=kind))
            trainer.fit(_packed_rows(32, seed=1), per_device_batch_size=1, max_steps=3, log_every=3)
        finally:
            layer_scan.pipelined_scan = real
        assert bool(calls) == (kind == "shard_map")
        runs.append(trainer)
    _assert_same_run(*runs[:2])
    for trainer, frozen_mlp in zip(runs[1:], (True, False)):
        hlo = trainer.compiled_step()
        scattered = [tuple(int(d) for d in m.split(",")) for m in
                     re.findall(r"= f32\[([\d,]+)\][^ ]* reduce-scatter\(", hlo.as_text())]
        # A shard of an MLP matrix (64 x 96 over 8 devices) is the only one with a dimension of 12.
        assert scattered and any(96 // 8 in s for s in scattered) != frozen_mlp, scattered


# ---- ZeRO++'s int8 collectives (engine.step.Int8; Trainer(zero_quantized_weights=..., zero_quantized_gradients=...))

def _on_mesh(fn, x, in_spec, out_spec, mesh):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False)(x)


@pytest.mark.parametrize("dim,axes", [(0, ("fsdp",)), pytest.param(1, ("fsdp",), marks=pytest.mark.slow),
                                      (1, ("data", "fsdp"))])
def test_int8_gather_and_reduce_scatter_are_exact_on_their_grid_and_bounded_off_it(dim, axes):
    """Values an int8 row grid holds exactly (integers, every row of every shard or chunk reaching 127) pass both
    collectives bit for bit, so the codes and scales travel in the exact collectives' device order; off the grid each
    gathered value is within 1/254 of its shard row's largest value."""
    mesh = engine.make_mesh(data=2, fsdp=4)
    P = jax.sharding.PartitionSpec
    spec = P(*[axes if d == dim else None for d in range(2)])
    dims = ((dim, axes),)
    rng = np.random.RandomState(0)
    grid = rng.randint(-127, 128, (16, 16)).astype(np.float32)
    grid[:, ::2] = 127  # every row of every (at most 8-way) column shard holds 127

    def gather(int8, x):
        return _on_mesh(lambda a: collectives.all_gather(a, dims, jnp.float32, int8), x, spec, P(), mesh)
    np.testing.assert_array_equal(gather(True, grid), grid)
    x = rng.randn(16, 16).astype(np.float32)
    shards = np.stack(np.split(x, 8 if axes == ("data", "fsdp") else 4, axis=dim))
    row_max = np.abs(shards).max(axis=-1, keepdims=True)
    err = np.abs(np.stack(np.split(np.asarray(gather(True, x)) - x, shards.shape[0], axis=dim)))
    assert (err <= row_max / 254 + 1e-6).all() and err.max() > 0

    full = rng.randint(-127, 128, (8, 16, 16)).astype(np.float32)  # one full-size gradient per device
    full[:, :, ::2] = 127

    def scatter(int8):
        return _on_mesh(lambda g: collectives.reduce_scatter(g[0], dims, jnp.float32, jnp.float32, int8)[None], full,
                        P(("data", "fsdp")), P(("data", "fsdp")), mesh)
    np.testing.assert_array_equal(scatter(True), scatter(False))


@pytest.mark.parametrize("zero_stage", [0, pytest.param(1, marks=pytest.mark.slow)])  # 0: both collectives
def test_int8_data_axis_reductions_are_exact_on_their_grid_and_bounded_off_it(zero_stage):
    """The data-axis reductions with int8 traffic (`Int8.gradients`): ZeRO-1/2's reduce-scatter and ZeRO-0's
    all-reduce (reduce-scatter, then the summed chunks all-gathered as int8) equal the float32 collectives bit for
    bit when every device's gradient lies on the int8 row grid (the sums too: the same integers on every device),
    and stay within two roundings of them otherwise."""
    mesh = engine.make_mesh(data=8)
    P = jax.sharding.PartitionSpec
    scatter, reduce = (((0, ("data",)),), ()) if zero_stage else ((), ("data",))
    out = P(("data",)) if zero_stage else P()

    def run(int8, full):
        def fn(g):
            y = collectives.reduce_gradient(g[0], scatter, reduce, jnp.float32, None, int8)
            return y if zero_stage else y[None]
        return np.asarray(_on_mesh(fn, full, P("data"), out if zero_stage else P("data"), mesh))

    rng = np.random.RandomState(0)
    grid = rng.randint(-127, 128, (16, 24)).astype(np.float32)
    grid[:, ::3] = 127
    same = np.broadcast_to(grid, (8, 16, 24)).copy()
    np.testing.assert_array_equal(run(True, same), run(False, same))
    full = rng.randn(8, 16, 24).astype(np.float32)
    exact, got = run(False, full), run(True, full)
    # each device's chunk row rounds to 1/254 of its largest entry; the sum's row once more
    bound = 8 * np.abs(full).max() / 254 + np.abs(exact).max() / 254
    assert np.abs(got - exact).max() <= bound and np.abs(got - exact).max() > 0


# The hand-pipelined layer stack on fsdp 8; the per-layer gathers with the model axis automatic beside fsdp.
@pytest.mark.parametrize("mesh,remat", [("1x8x1", "full"), pytest.param("1x4x2", "none", marks=pytest.mark.slow)])
def test_int8_zero3_step_trains_like_the_exact_one_and_sends_int8(mesh, remat):
    """A scanned LLaMA with ZeRO-3: 'auto' picks the shard_map step; losses and parameters stay close to the exact
    step's (the forward sees dequantised weights, the gradients come rounded); in the compiled step the weight
    matrices' gathers and their gradients' exchanges are int8 and no float32 reduce-scatter is left."""
    ops = _int8_run_like_the_exact_one(mesh, remat, 0, zero_quantized_weights=True, zero_quantized_gradients=True)
    assert any("= s8[" in line for line in ops("all-gather")) and any("s8[" in line for line in ops("all-to-all"))
    # What may be left of the reduce-scatters: the vocab-parallel lookup's [1, tokens, hidden] vectors, no gradient.
    assert {len(m.split(",")) for line in ops("reduce-scatter") for m in re.findall(r"= f32\[([\d,]+)\]", line)} <= {3}


@pytest.mark.parametrize("mesh,zero_stage", [("8x1x1", 0), pytest.param("2x2x2", 2, marks=pytest.mark.slow),
                                             pytest.param("2x1x2c2", 1, marks=pytest.mark.slow)])  # context manual
def test_int8_data_parallel_step_trains_like_the_exact_one_and_sends_int8(mesh, zero_stage):
    """zero_quantized_gradients on data-parallel meshes (no fsdp needed): the LLaMA's losses and moves stay close to
    the exact step's, and no float32 all-reduce or reduce-scatter of a gradient matrix is left in the compiled
    step (int8 all-to-alls and all-gathers instead)."""
    ops = _int8_run_like_the_exact_one(mesh, "full", zero_stage, zero_quantized_gradients=True)
    assert any("s8[" in line for line in ops("all-to-all")) and any("= s8[" in line for line in ops("all-gather"))
    # (With `model` the tensor-parallel activations, [1 row, 16 tokens / context, ...], are all-reduced over it.)
    tokens = 16 // _INT8_MESHES[mesh].get("context", 1)
    float_matrices = [m for name in ("all-reduce", "reduce-scatter") for line in ops(name)
                      for m in re.findall(r"= f32\[(\d+,\d+[\d,]*)\]", line) if not m.startswith(f"1,{tokens},")
                      and m != f"1,{tokens}"]
    assert not float_matrices, float_matrices


_INT8_MESHES = {**MESHES, "2x1x2c2": dict(data=2, context=2, model=2)}  # c2: context 2, manual in the step


def _int8_run_like_the_exact_one(mesh, remat, zero_stage, **int8):
    """Trains a scanned LLaMA 3 steps with the exact shard_map step and with the `int8` Trainer options; asserts
    'auto' picked the shard_map step, the losses agree (rtol 2e-3) and each parameter's move is within 5% of the
    exact move's largest entry. Returns ops(name): the compiled int8 step's lines of that collective."""
    model = models.FAMILIES["llama"].Model(models.get_config("llama", "tiny", scan_layers=True, remat=remat))
    params = models.init_params(model, jax.random.PRNGKey(0))

    def run(**kwargs):
        trainer = engine.Trainer(mesh=engine.make_mesh(**_INT8_MESHES[mesh]), collate_fn=lm.collate_lm,
                                 loss_fn=lm.lm_loss_fn(model), params=params, optimizer=optax.sgd(0.5),
                                 parallelism=engine.Parallelism(zero_stage=zero_stage, **kwargs))
        trainer.fit(_packed_rows(32), per_device_batch_size=1, max_steps=3, log_every=1)
        return trainer

    ref, got = run(step="shard_map"), run(**int8)
    assert got._step_kind == "shard_map" and got.compile_count == 1
    np.testing.assert_allclose([h["loss"] for h in got.history], [h["loss"] for h in ref.history], rtol=2e-3)
    for (path, x0), x, y in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(
            jax.device_get(ref.params)), jax.tree.leaves(jax.device_get(got.params))):
        moved = np.abs(np.asarray(x) - np.asarray(x0)).max()
        assert np.abs(np.asarray(y) - np.asarray(x)).max() <= 5e-2 * moved, jax.tree_util.keystr(path)
    hlo = got.compiled_step().as_text()
    return lambda name: [line for line in hlo.splitlines() if f" {name}(" in line]


def test_int8_collectives_bad_input():
    mesh = engine.make_mesh(fsdp=8)
    common = dict(collate_fn=lm.collate_lm, loss_fn=lambda *a: 0.0, params={"w": jnp.zeros((8, 8))},
                  optimizer=optax.sgd(0.1))
    for kwargs, message in [
            (dict(zero_quantized_weights=True, step="jit"), r"zero_quantized_weights=True; expected False unless "
                                                            r"the step is 'shard_map'"),
            (dict(zero_quantized_gradients=1), r"zero_quantized_gradients=1; expected a bool")]:
        with pytest.raises(ValueError, match=message):
            engine.Trainer(mesh=mesh, **common, parallelism=engine.Parallelism(**kwargs))
    with pytest.raises(ValueError, match=r"zero_quantized_gradients=True; expected False unless"):
        engine.Trainer(mesh=mesh, **common, parallelism=engine.Parallelism(zero_quantized_gradients=True),
                       diloco=engine.DiLoCo(inner_steps=2))
    with pytest.raises(ValueError, match=r"zero_quantized_weights=True; expected False on a mesh with fsdp=1"):
        engine.Trainer(mesh=engine.make_mesh(data=8), **common,
                       parallelism=engine.Parallelism(zero_quantized_weights=True))
    with pytest.raises(ValueError, match=r"zero_quantized_gradients=True; expected False on a mesh with data=1, "
                                         r"fsdp=1, expert=1 and context=1"):
        engine.Trainer(mesh=engine.make_mesh(data=1, model=8), **common,
                       parallelism=engine.Parallelism(zero_quantized_gradients=True))
    with pytest.raises(ValueError, match=r"int8=True; expected an engine.step.Int8"):
        step_lib.shard_map_train_step(loss_fn=None, optimizer=None, mesh=mesh, param_specs=None, update_specs=None,
                                      zero_stage=0, accumulate=1, compute_dtype=None, remat=False, key=None, int8=True)


def test_chunked_loss_trains_like_plain_logits_in_both_steps():
    """The head + loss in row chunks with the gradients taken in the forward (lm_loss_fn(model, 'chunked'),
    kernels.linear_cross_entropy_sum) under the Trainer, on data 2 x fsdp 2 x model 2 (the head split over model and
    ZeRO-3 gathered over fsdp): both steps' updates equal plain logits' in the jit step, and so do the losses."""
    model = models.create_model("llama", "tiny", scan_layers=True, intermediate_size=96)
    params = models.init_params(model, jax.random.PRNGKey(1))
    runs = []
    for kind, implementation in (("jit", None), ("jit", "chunked"), ("shard_map", "chunked")):
        loss = lm.lm_loss_fn(model, implementation)
        trainer = engine.Trainer(mesh=engine.make_mesh(**MESHES["2x2x2"]), collate_fn=lm.collate_lm, loss_fn=loss,
                                 params=params, optimizer=optax.sgd(0.5), parallelism=engine.Parallelism(step=kind))
        trainer.fit(_packed_rows(16, seq=10, seed=1), per_device_batch_size=2, max_steps=2, log_every=1)
        runs.append(trainer)
    plain = runs[0]
    for got in runs[1:]:
        np.testing.assert_allclose([h["loss"] for h in got.history], [h["loss"] for h in plain.history], rtol=1e-5)
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(jax.device_get(plain.params))[0],
                                jax.tree.leaves(jax.device_get(got.params))):
            err = np.abs(np.asarray(a) - np.asarray(b)).max() / max(np.abs(np.asarray(a)).max(), 1e-3)
            assert err <= 1e-5, (jax.tree_util.keystr(path), err)


@pytest.mark.parametrize("loss_scale", [None, engine.LossScale(initial=4.0)])
def test_the_select_guard_and_the_conditional_guard_agree(loss_scale):
    """`apply_update`'s two guards (a `where` per leaf on TPU and GPU, `lax.cond` on CPU: `select_guard`): the same
    update on a finite step; on a non-finite loss or gradient both keep every parameter and moment."""
    from tests.targets import H200
    assert step_lib.select_guard(jax.devices("cpu")[0]) is False and step_lib.select_guard(H200) is True
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    optimizer = optax.adamw(0.1)
    state = step_lib.init_opt_state(optimizer, params, loss_scale)
    grads = {"w": jnp.full((2, 3), 0.5), "b": jnp.array([1.0, -2.0, 3.0])}
    for loss, g in ((jnp.float32(1.0), grads), (jnp.float32(jnp.nan), grads),
                    (jnp.float32(1.0), {**grads, "b": jnp.array([1.0, jnp.inf, 3.0])})):
        out = [jax.jit(lambda p, s, g, l, select=select: step_lib.apply_update(
            optimizer, p, s, g, l, {}, loss_scale, select))(params, state, g, loss) for select in (False, True)]
        for a, b in zip(jax.tree.leaves(out[0][:2]), jax.tree.leaves(out[1][:2])):
            np.testing.assert_array_equal(a, b)
        assert bool(out[1][2]["finite"]) == bool(jnp.isfinite(loss) and all(jnp.isfinite(x).all() for x in g.values()))
        if not out[1][2]["finite"]:  # parameters and moments as they were (a loss scale moves on)
            kept = (out[1][0], out[1][1] if loss_scale is None else out[1][1]["optimizer"])
            before = (params, state if loss_scale is None else state["optimizer"])
            for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(kept)):
                np.testing.assert_array_equal(a, b)
