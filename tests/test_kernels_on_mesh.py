"""Pallas kernels under a mesh (kernels/_partition.py): each device runs the kernel on its own batch rows and heads /
output columns, the results and gradients equal the unsharded reference, and the accelerator lowering shows
per-device operand shapes (without the partitioning, every device would receive the full inputs)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import engine
import kernels
from tests.targets import for_gpu, kernel_operands_of_train_step


def _mesh():
    return engine.make_mesh(data=2, fsdp=2, model=2)


def _put(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _normal(key, shape):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _value_and_grads(fn, args):
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=tuple(range(len(args)))))(*args)


def _assert_close(got, want, tol=2e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


def _cases():
    seg = jnp.asarray(np.repeat(np.array([[1, 1, 2, 2]]), 8, axis=1).repeat(4, axis=0), jnp.int32)  # [4, 32]
    return {
        "attention": (
            lambda impl, q, k, v: kernels.flash_attention(q, k, v, causal=True, segment_ids=seg, **impl),
            [(_normal(0, (4, 32, 4, 16)), P(("data", "fsdp"), None, "model", None)),
             (_normal(1, (4, 32, 2, 16)), P(("data", "fsdp"), None, "model", None)),
             (_normal(2, (4, 32, 2, 16)), P(("data", "fsdp"), None, "model", None))]),
        # Dropout keys follow the kernel's rows and heads: the mask of each device's slice is the whole's.
        "attention_dropout": (
            lambda impl, q, k, v: kernels.flash_attention(q, k, v, causal=True, dropout_rate=0.3,
                                                          dropout_rng=jax.random.key(7), **impl),
            [(_normal(0, (4, 32, 4, 16)), P(("data", "fsdp"), None, "model", None)),
             (_normal(1, (4, 32, 2, 16)), P(("data", "fsdp"), None, "model", None)),
             (_normal(2, (4, 32, 2, 16)), P(("data", "fsdp"), None, "model", None))]),
        "gated_mlp": (
            lambda impl, x, g, u: kernels.gated_mlp(x, g, u, **impl),
            [(_normal(3, (4, 8, 32)), P(("data", "fsdp"))), (_normal(4, (32, 128)), P(None, "model")),
             (_normal(5, (32, 128)), P(None, "model"))]),
        "fused_matmul": (
            lambda impl, x, w, b: kernels.fused_matmul(x, w, b, activation="gelu", **impl),
            [(_normal(6, (4, 8, 32)), P(("data", "fsdp"))), (_normal(7, (32, 128)), P(None, "model")),
             (_normal(8, (128,)), P("model"))]),
        "linear_cross_entropy": (
            lambda impl, x, w: kernels.linear_cross_entropy(
                x, w, jnp.arange(32).reshape(4, 8) % 48 - (jnp.arange(32).reshape(4, 8) == 5) * 200, **impl),
            [(_normal(9, (4, 8, 32)), P(("data", "fsdp"))), (_normal(10, (32, 48)), P(None, "model"))]),
    }


@pytest.mark.parametrize("op", list(_cases()))
def test_pallas_kernel_on_a_mesh_equals_the_reference(op):
    fn, inputs = _cases()[op]
    mesh = _mesh()
    want = _value_and_grads(lambda *a: fn(dict(implementation="xla"), *a), [x for x, _ in inputs])
    sharded = [_put(mesh, x, spec) for x, spec in inputs]
    with jax.set_mesh(mesh):
        got = _value_and_grads(lambda *a: fn(dict(implementation="triton", interpret=True), *a), sharded)
    _assert_close(got, want)


@pytest.mark.parametrize("op, local, full", [
    ("attention", "tensor<1x32x2x16xbf16>", "tensor<4x"),
    ("gated_mlp", "tensor<32x64xbf16>", "tensor<32x128xbf16>"),  # columns: 128 / model 2
    ("fused_matmul", "tensor<32x64xbf16>", "tensor<32x128xbf16>"),
    ("linear_cross_entropy", "tensor<16x32xbf16>", "tensor<32x32xbf16>"),  # rows: 32 / 4 = 8, padded to a tile of 16
])
def test_lowering_for_cuda_runs_each_kernel_on_local_blocks(op, local, full):
    """Per device: 4 rows / (data 2 x fsdp 2) = 1 row (8 tokens for the matmuls), heads and columns / model 2."""
    fn, inputs = _cases()[op]
    mesh = _mesh()
    args = [jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec)) for x, spec in inputs]
    with jax.set_mesh(mesh), for_gpu(mesh):
        lowered = jax.jit(jax.grad(lambda *a: jnp.sum(fn(dict(implementation="triton"), *a).astype(jnp.float32)),
                                   argnums=tuple(range(len(args))))).trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    calls = re.findall(r"stablehlo.custom_call @__gpu\$xla\.gpu\.triton\((.*?)\)", text)
    assert calls
    operand_types = re.findall(r"custom_call @__gpu\$xla\.gpu\.triton\(.*?\).*?: \((.*?)\) ->", text)
    assert operand_types and all(full not in t for t in operand_types), operand_types
    assert any(local in t for t in operand_types), operand_types


@pytest.mark.parametrize("op", list(_cases()))
def test_lowering_for_tpu_on_an_engine_mesh(op):
    """Mosaic refuses a custom call in a region with an automatic axis, and every engine mesh has size-1 ones
    (stage, context): the kernels' shard_map makes them manual, so each kernel lowers for TPU with its local blocks.
    (Before, none lowered on any engine mesh.)"""
    fn, inputs = _cases()[op]
    mesh = _mesh()
    args = [jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec)) for x, spec in inputs]
    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(lambda *a: jnp.sum(fn(dict(implementation="mosaic_tpu"), *a).astype(jnp.float32)),
                                argnums=tuple(range(len(args))))).trace(*args).lower(
            lowering_platforms=("tpu",)).as_text()
    operands = re.findall(r"custom_call @tpu_custom_call\(.*?\).*?: \((.*?)\) ->", text)
    assert operands and all(not re.search(r"tensor<4x", t) for t in operands), operands  # 1 of the 4 rows


@pytest.mark.parametrize("op", [
    "fused_matmul",
    *[pytest.param(op, marks=pytest.mark.slow) for op in ("attention", "gated_mlp", "linear_cross_entropy")],  # 9-18 s
])
def test_interpreted_mosaic_kernel_on_a_mesh_equals_the_reference(op):
    fn, inputs = _cases()[op]
    mesh = _mesh()
    want = _value_and_grads(lambda *a: fn(dict(implementation="xla"), *a), [x for x, _ in inputs])
    with jax.set_mesh(mesh):
        got = _value_and_grads(lambda *a: fn(dict(implementation="mosaic_tpu", interpret=True), *a),
                               [_put(mesh, x, spec) for x, spec in inputs])
    _assert_close(got, want)


def test_outside_a_mesh_nothing_changes():
    x, w = _normal(0, (8, 32)), _normal(1, (32, 64))
    with for_gpu():
        lowered = jax.jit(lambda x, w: kernels.gated_mlp(x, w, w, implementation="triton")).trace(x, w).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "shard_map" not in lowered and "sdy.manual_computation" not in lowered


@pytest.mark.parametrize("step", ["shard_map", "jit"])
def test_train_step_lowered_for_cuda_runs_kernels_on_local_heads(step):
    """The Trainer's step for a scan-over-layers LLaMA with Triton attention and MLP kernels on a 1x4x2 mesh, lowered
    for cuda: inside the shard_map step (`model` automatic) the attention kernel sees its own row and half the heads
    (4 query, 2 kv heads / model 2), the gated MLP half the columns."""
    import optax

    import models
    from engine.tasks import lm
    model = models.create_model("llama", "tiny", scan_layers=True, remat="full", attention_implementation="triton",
                                mlp_implementation="triton")
    params = jax.eval_shape(lambda: models.init_params(model, jax.random.PRNGKey(0)))
    trainer = engine.Trainer(mesh=engine.make_mesh(data=1, fsdp=4, model=2), collate_fn=lm.collate_lm,
                             loss_fn=lm.lm_loss_fn(model), params=params, optimizer=optax.sgd(0.1),
                             parallelism=engine.Parallelism(step=step))
    operands = kernel_operands_of_train_step(trainer, 4, 32)
    attention = [t for t in operands if re.search(r"tensor<\d+x32x\d+x16x", t)]
    assert attention and all(re.search(r"tensor<1x32x2x16x", t) for t in attention), attention
    assert all("64x128x" not in t for t in operands)  # the gate/up weights are never whole


@pytest.mark.parametrize("step", ["shard_map", "jit"])
def test_train_step_lowered_for_tpu_runs_mosaic_kernels(step):
    """The same LLaMA with Mosaic attention, MLP and fused loss kernels lowers for TPU in both steps (before, the
    mesh's size-1 automatic axes made every Mosaic kernel refuse), the attention on its row and half the heads
    (heads-major: [1, 2, T, 16])."""
    import optax

    import models
    from engine.tasks import lm
    model = models.create_model("llama", "tiny", scan_layers=True, remat="full", attention_implementation="mosaic_tpu",
                                mlp_implementation="mosaic_tpu")
    params = jax.eval_shape(lambda: models.init_params(model, jax.random.PRNGKey(0)))
    trainer = engine.Trainer(mesh=engine.make_mesh(data=1, fsdp=4, model=2), collate_fn=lm.collate_lm,
                             loss_fn=lm.lm_loss_fn(model, implementation="mosaic_tpu"), params=params,
                             optimizer=optax.sgd(0.1), parallelism=engine.Parallelism(step=step))
    operands = kernel_operands_of_train_step(trainer, 4, 256, platform="tpu")
    attention = [t for t in operands if re.search(r"tensor<\d+x\d+x256x16x", t)]
    assert len(operands) > len(attention) > 0 and all(re.search(r"tensor<1x2x256x16x", t) for t in attention), operands


def test_generate_traces_under_the_parameters_mesh(monkeypatch):
    """models.generate on parameters placed on a mesh traces under that mesh (so its Pallas kernels are
    partitioned), and greedy tokens equal those of unsharded parameters."""
    import importlib

    import models
    gen = importlib.import_module("models.generate")  # the module: `models.generate` is the function
    model = models.create_model("llama", "tiny")
    params = models.init_params(model, jax.random.PRNGKey(0))
    prompt = jnp.asarray(np.arange(12).reshape(2, 6) % 100, jnp.int32)
    want = models.generate(model, params, prompt, max_new_tokens=4)
    mesh = engine.make_mesh(data=1, fsdp=4, model=2)
    placed = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), engine.auto_shard(params, mesh),
                                                 is_leaf=lambda s: isinstance(s, P)))
    seen = []
    real = gen._compiled

    def spy(*args):
        run = real(*args)
        return lambda *a: seen.append(jax.sharding.get_abstract_mesh()) or run(*a)

    monkeypatch.setattr(gen, "_compiled", spy)
    got = models.generate(model, placed, prompt, max_new_tokens=4)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert seen and dict(seen[0].shape) == {"stage": 1, "data": 1, "fsdp": 4, "context": 1, "model": 2, "expert": 1}


@pytest.mark.parametrize("impl", [dict(implementation="xla"), dict(implementation="triton", interpret=True)])
def test_vocab_parallel_cross_entropy_equals_the_reference(impl):
    """kernels.matmul.VocabParallelLoss.run inside a shard_map over 8 devices (rows and vocabulary both split 8 ways),
    with ignored tokens and labels in every slice: loss and gradients equal the materialised reference."""
    from kernels.matmul import reference
    n, d, v = 64, 32, 256
    x, w = _normal(0, (n, d)), _normal(1, (d, v))
    labels = (jnp.arange(n) * 37) % v
    labels = jnp.where(jnp.arange(n) % 5 == 0, -100, labels).astype(jnp.int32)
    # The call's settings, as the engine finds them: in the traced program of the public op (full-size weight).
    traced = jax.make_jaxpr(lambda x, w: kernels.linear_cross_entropy(x, w, labels, **impl))(x, w)
    call = next(c for c in map(kernels.matmul.vocab_parallel_loss, traced.jaxpr.eqns) if c is not None)
    mesh = engine.make_mesh(data=1, fsdp=8)

    def sharded(x, w):
        return jax.shard_map(lambda x, w, l: call.run(x, w, l, "fsdp"), mesh=mesh,
                             in_specs=(P("fsdp"), P(None, "fsdp"), P("fsdp")), out_specs=P("fsdp"),
                             check_vma=False)(x, w, labels)

    want = _value_and_grads(lambda x, w: reference.linear_cross_entropy_reference(x, w, labels), [x, w])
    got = _value_and_grads(sharded, [x, w])
    _assert_close(got, want, tol=1e-4)


def test_vocab_parallel_cross_entropy_found_around_a_pallas_call():
    """Inside the shard_map step (data and fsdp manual, the other axes automatic) a Pallas loss sits in a shard_map
    of its own over the automatic axes: `vocab_parallel_loss` finds the call through it (else the step gathers the
    whole head), and its `run` there (Triton, interpreted) equals the materialised reference, loss and gradients."""
    from kernels.matmul import reference
    n, d, v = 64, 32, 256
    x, w = _normal(0, (n, d)), _normal(1, (d, v))
    labels = jnp.where(jnp.arange(n) % 5 == 0, -100, (jnp.arange(n) * 37) % v).astype(jnp.int32)
    mesh = engine.make_mesh(data=1, fsdp=8)

    def in_step(fn):
        return jax.shard_map(fn, mesh=mesh, in_specs=(P("fsdp"), P(None, "fsdp"), P("fsdp")), out_specs=P("fsdp"),
                             axis_names={"data", "fsdp"}, check_vma=False)

    loss = lambda x, w, l: kernels.linear_cross_entropy(x, w, l, implementation="triton", interpret=True)  # noqa: E731
    traced = jax.make_jaxpr(in_step(loss))(x, w, labels)
    (step_body,) = [e.params["jaxpr"] for e in traced.jaxpr.eqns if e.primitive.name == "shard_map"]
    assert [e.primitive.name for e in step_body.eqns] == ["shard_map"]
    call = kernels.matmul.vocab_parallel_loss(step_body.eqns[0])
    assert call is not None and call.cfg.implementation == "triton"

    def sharded(x, w):
        return in_step(lambda x, w, l: call.run(x, w, l, "fsdp"))(x, w, labels)

    want = _value_and_grads(lambda x, w: reference.linear_cross_entropy_reference(x, w, labels), [x, w])
    _assert_close(_value_and_grads(sharded, [x, w]), want, tol=1e-4)


@pytest.mark.parametrize("cache", ["float", "int8"])
def test_decode_attention_on_a_mesh_equals_the_reference(cache):
    """kernels.decode_attention under a 2x2x2 mesh (rows over data x fsdp, kv heads over model; the cache's splits
    become extra rows of each device's block): the interpreted Triton kernel equals the unsharded 'xla' path, with a
    float and an int8 cache."""
    mesh = _mesh()
    rows, heads = P(("data", "fsdp"), None, "model", None), P(("data", "fsdp"), None, "model")
    q, k, v = _normal(11, (4, 1, 4, 16)), _normal(12, (4, 64, 2, 16)), _normal(13, (4, 64, 2, 16))
    ids = (jnp.ones((4, 1), jnp.int32), jnp.asarray(np.arange(64)[None] < np.array([[64], [40], [9], [0]]),
                                                    jnp.int32))
    scales = {}
    if cache == "int8":
        (k, k_scale), (v, v_scale) = kernels.quantize_kv(k), kernels.quantize_kv(v)
        scales = dict(k_scale=k_scale, v_scale=v_scale)

    def run(impl, q, k, v, scales):
        return kernels.decode_attention(q, k, v, segment_ids=ids, num_splits=2, **scales, **impl)

    want = jax.jit(lambda *a: run(dict(implementation="xla"), *a))(q, k, v, scales)
    placed = [_put(mesh, x, rows) for x in (q, k, v)] + [{n: _put(mesh, s, heads) for n, s in scales.items()}]
    with jax.set_mesh(mesh):
        got = jax.jit(lambda *a: run(dict(implementation="triton", interpret=True), *a))(*placed)
    _assert_close(got, want)
    np.testing.assert_array_equal(np.asarray(got[3]), 0.0)  # an empty cache row
