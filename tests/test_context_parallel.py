"""Context parallelism (the mesh's `context` axis): each row's tokens split over a group of devices, attention
exchanging sequence slices for head slices (kernels.attention.api._context_parallel). Results equal the unsplit
computation; the compiled program exchanges per-device blocks only."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import engine
import kernels
import models
from engine.tasks import lm, planning, seq2seq
from tests.targets import for_gpu, kernel_operands_of_train_step
from tests.test_step import _packed_rows


def _normal(key, shape):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _attention_case(kv_heads, q_len=64, kv_len=64):
    B, H, D = 2, 8, 16
    seg = np.repeat(np.array([[1, 1, 2, 2]]), q_len // 4, axis=1).repeat(B, axis=0)
    q, k, v = _normal(0, (B, q_len, H, D)), _normal(1, (B, kv_len, kv_heads, D)), _normal(2, (B, kv_len, kv_heads, D))
    return q, k, v, jnp.asarray(seg, jnp.int32)


def _grads(fn, args):
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=(0, 1, 2)))(*args)


@pytest.mark.parametrize("impl, kv_heads, mesh, dropout", [
    ("xla", 4, dict(data=2, context=2, model=2), 0.0),      # k, v through the all-to-all
    ("xla", 1, dict(data=1, context=4, model=2), 0.3),      # one kv head: gathered, each device picks it
    ("triton", 2, dict(data=2, context=2, model=2), 0.3),
    pytest.param("triton", 8, dict(data=1, context=8), 0.0, marks=pytest.mark.slow),  # CI time: xla has it
])
def test_attention_on_a_context_mesh_equals_the_unsplit_attention(impl, kv_heads, mesh, dropout):
    q, k, v, seg = _attention_case(kv_heads)
    opts = dict(implementation=impl, interpret=impl != "xla")

    def attend(q, k, v, **impl_opts):
        return kernels.flash_attention(q, k, v, causal=True, segment_ids=seg, dropout_rate=dropout,
                                       dropout_rng=jax.random.key(3) if dropout else None, **impl_opts)

    want = _grads(lambda *a: attend(*a, implementation="xla"), (q, k, v))
    mesh = engine.make_mesh(**mesh)
    placed = [jax.device_put(x, NamedSharding(mesh, P("data", "context"))) for x in (q, k, v)]
    with jax.set_mesh(mesh):
        got = _grads(lambda *a: attend(*a, **opts), placed)
    value_scale = float(jnp.abs(want[0]))
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5, atol=1e-5 * value_scale)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_cross_attention_of_different_lengths_on_a_context_mesh():
    q, k, v, _ = _attention_case(4, q_len=32, kv_len=64)
    want = _grads(lambda *a: kernels.flash_attention(*a, implementation="xla"), (q, k, v))
    mesh = engine.make_mesh(data=2, context=4)
    placed = [jax.device_put(x, NamedSharding(mesh, P("data", "context"))) for x in (q, k, v)]
    with jax.set_mesh(mesh):
        got = _grads(lambda *a: kernels.flash_attention(*a, implementation="xla"), placed)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-4)


def test_the_compiled_exchange_moves_per_device_blocks_only():
    """On data 2 x context 2 x model 2 every all-to-all carries one device's rows and model heads (B/2, H/2), q, k
    and v are never all-gathered (only the int32 segment ids are), and nothing is gathered over rows or heads."""
    q, k, v, seg = _attention_case(4)
    mesh = engine.make_mesh(data=2, context=2, model=2)
    spec = NamedSharding(mesh, P("data", "context", "model"))
    placed = [jax.device_put(x, spec) for x in (q, k, v)]
    loss = lambda *a: jnp.sum(kernels.flash_attention(*a, causal=True, segment_ids=seg, implementation="xla"))  # noqa
    with jax.set_mesh(mesh):
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*placed).compile().as_text()
    exchanges = re.findall(r"= \((.*?)\) all-to-all\(", hlo)
    assert exchanges
    for operands in exchanges:  # pieces of [B/2, T/2 or T, heads/2/2 or heads/2, D]: never the whole rows
        for shape in re.findall(r"f32\[([\d,]+)\]", operands):
            b, t, h, d = map(int, shape.split(","))
            assert b == 1 and d == 16 and h <= 2 and t <= 32, operands
    gathered = re.findall(r"= (\w+)\[[\d,]*\]\{[^}]*\} all-gather\(", hlo)
    assert gathered and set(gathered) == {"s32"}, gathered


def _ring_case(heads, kv_heads, q_len, kv_len, dtype=jnp.float32):
    B, D = 2, 16
    q, k, v = (_normal(i, (B, n, h, D)).astype(dtype) for i, n, h in ((0, q_len, heads), (1, kv_len, kv_heads),
                                                                       (2, kv_len, kv_heads)))
    seg = np.repeat(np.array([[1, 1, 2, 2]]), q_len // 4, axis=1).repeat(B, axis=0)
    return q, k, v, (jnp.asarray(seg, jnp.int32) if q_len == kv_len else None)


@pytest.mark.parametrize("impl, heads, kv_heads, mesh, causal, lengths", [
    ("xla", 4, 2, dict(data=1, context=8), True, (64, 64)),          # 4 heads per device, context 8
    ("xla", 2, 2, dict(data=2, context=2, model=2), True, (64, 64)),  # 1 head per model shard, context 2
    ("xla", 4, 2, dict(data=2, context=4), False, (32, 64)),          # cross attention, 8 queries to 16 keys a block
    ("xla", 4, 2, dict(data=1, context=8), True, (72, 72)),           # 9 tokens a device: the contiguous causal ring
    ("triton", 4, 2, dict(data=2, context=4), True, (64, 64)),        # 16 tokens a block: one tile with padding
    # The TPU interpreter runs a kernel only when every device runs it, so the causal ring's per-device branches
    # (diagonal, visible, future blocks) deadlock it; non-causal, every device runs the same kernels.
    pytest.param("mosaic_tpu", 2, 1, dict(data=2, context=4), False, (512, 512), marks=pytest.mark.slow),  # ~30 s
])
def test_ring_attention_on_a_context_mesh_equals_the_unsplit_attention(impl, heads, kv_heads, mesh, causal, lengths):
    """Heads per device that do not divide by context: the k / v blocks go round the ring (`api._ring`); causal with
    an even number of tokens per device in the zigzag layout."""
    q, k, v, seg = _ring_case(heads, kv_heads, *lengths)
    attend = lambda *a, **o: kernels.flash_attention(*a, causal=causal, segment_ids=seg, **o)  # noqa: E731
    want = _grads(lambda *a: attend(*a, implementation="xla"), (q, k, v))
    mesh = engine.make_mesh(**mesh, devices=jax.devices()[:int(np.prod(list(mesh.values())))])
    spec = NamedSharding(mesh, P("data", "context", "model" if "model" in mesh.shape else None))
    with jax.set_mesh(mesh):
        got = _grads(lambda *a: attend(*a, implementation=impl, interpret=impl != "xla"),
                     [jax.device_put(x, spec) for x in (q, k, v)])
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5, atol=1e-5 * float(jnp.abs(want[0])))
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_ring_attention_in_bfloat16_is_within_its_rounding():
    """bf16 inputs: each block's partial output and gradients are rounded to bf16 before the float32 merge, so the
    ring's error against float32 attention is a small multiple of the unsplit kernel's (about 1.6x here)."""
    q, k, v, seg = _ring_case(4, 2, 64, 64, jnp.bfloat16)
    attend = lambda *a: kernels.flash_attention(*a, causal=True, segment_ids=seg, implementation="xla")  # noqa: E731
    want = _grads(attend, [x.astype(jnp.float32) for x in (q, k, v)])
    unsplit = _grads(attend, (q, k, v))
    mesh = engine.make_mesh(data=1, context=8)
    with jax.set_mesh(mesh):
        got = _grads(attend, [jax.device_put(x, NamedSharding(mesh, P(None, "context"))) for x in (q, k, v)])
    for g, u, w in zip(got[1], unsplit[1], want[1]):
        w = np.asarray(w)
        error = lambda x: float(np.abs(np.asarray(x, np.float32) - w).max() / np.abs(w).max())  # noqa: E731
        assert error(g) < 2e-2 and error(g) < 3 * error(u), (error(g), error(u))


def test_the_compiled_ring_passes_kv_blocks_only():
    """data 2 x context 4, 2 heads, causal: every collective is a collective-permute of one device's block (1 row, 16
    of the 64 tokens: k, v and their ids forward, dk, dv in float32 backward) or of a half-block (8 tokens: the
    zigzag layout's exchange of q, k, v, ids and the output); no all-to-all, no all-gather."""
    q, k, v, seg = _ring_case(2, 2, 64, 64)
    mesh = engine.make_mesh(data=2, context=4, devices=jax.devices()[:8])
    placed = [jax.device_put(x, NamedSharding(mesh, P("data", "context"))) for x in (q, k, v)]
    loss = lambda *a: jnp.sum(kernels.flash_attention(*a, causal=True, segment_ids=seg, implementation="xla"))  # noqa
    with jax.set_mesh(mesh):
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*placed).compile().as_text()
    assert "all-to-all(" not in hlo and "all-gather(" not in hlo
    passed = set(re.findall(r"= (\w+\[[\d,]*\])\{[^}]*\} collective-permute\(", hlo))
    assert {"f32[1,16,2,16]", "f32[1,8,2,16]", "s32[1,16]"} <= passed, passed
    assert passed <= {"f32[1,16,2,16]", "f32[1,8,2,16]", "s32[1,16]", "s32[1,8]"}, passed


def test_the_zigzag_layout_gives_device_c_half_blocks_c_and_its_mirror():
    """Causal ring attention's layout (`api._RingPlan.to_zigzag`) on context 4: device c holds half-blocks c and
    7 - c of the sequence (so every device's causal work is the same), and `from_zigzag` restores the order."""
    from kernels.attention.api import _RingPlan
    ring = _RingPlan("xla", True, None, False, None, 4, True)
    mesh = engine.make_mesh(data=2, context=4)
    tokens = jnp.arange(2 * 32).reshape(2, 32)  # half-blocks of 4 tokens: token t is in half-block t // 4
    run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(None, "context"),  # noqa: E731
                                          out_specs=P(None, "context")))(tokens)
    half_blocks = np.asarray(run(ring.to_zigzag))[0].reshape(4, 2, 4) // 4  # [device, slot, token]
    np.testing.assert_array_equal(half_blocks[:, 0, 0], [0, 1, 2, 3])
    np.testing.assert_array_equal(half_blocks[:, 1, 0], [7, 6, 5, 4])
    assert (half_blocks == half_blocks[..., :1]).all()
    np.testing.assert_array_equal(run(lambda x: ring.from_zigzag(ring.to_zigzag(x))), tokens)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_ring_attention_lowers_for_the_accelerators(platform):
    """A causal 32k-token sequence of 4 heads (bf16, head_dim 128) over context 8: each device's kernels see its
    4096 queries with its own 4096 keys, or (zigzag) all its queries with half of another device's keys or half of
    its queries with all of them: operands of 4096 and 2048 tokens, never more."""
    impl, custom_call = {"cuda": ("triton", "__gpu$xla.gpu.triton"), "tpu": ("mosaic_tpu", "tpu_custom_call")}[platform]
    mesh = engine.make_mesh(data=1, context=8)
    x = jax.ShapeDtypeStruct((1, 32768, 4, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "context")))
    loss = lambda *a: jnp.sum(kernels.flash_attention(*a, causal=True, implementation=impl).astype(jnp.float32))  # noqa
    with for_gpu(mesh) if platform == "cuda" else jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(lowering_platforms=(platform,)).as_text()
    assert "collective_permute" in text and "all_to_all" not in text
    operands = " ".join(re.findall(rf"custom_call @{re.escape(custom_call)}\(.*?\).*?: \((.*?)\) ->", text))
    shapes = set(re.findall(r"tensor<1x(\d+)x4x128xbf16>", operands) + re.findall(r"tensor<1x4x(\d+)x128x", operands))
    assert shapes == {"4096", "2048"}, shapes


def test_ring_attention_refuses_dropout_and_causal_cross_attention():
    q, k, v, _ = _ring_case(4, 2, 64, 64)
    mesh = engine.make_mesh(data=1, context=8)
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"dropout_rate=0.1 on a mesh with context=8 whose 4 query heads per "
                                             r"device do not divide by it \(ring attention\); expected dropout_rate=0"):
            jax.jit(lambda *a: kernels.flash_attention(*a, dropout_rate=0.1, dropout_rng=jax.random.key(0),
                                                       implementation="xla")).lower(q, k, v)
        with pytest.raises(ValueError, match=r"causal=True\) of 32 queries to 64 keys on a mesh with context=8 "
                                             r"\(ring attention\); expected equal lengths"):
            jax.jit(lambda *a: kernels.flash_attention(*a, causal=True, implementation="xla")).lower(q[:, :32], k, v)


def test_lengths_that_do_not_divide_run_unsplit():
    """A prompt of a length the context size does not divide (a prefill, say) runs the plain attention."""
    q, k, v, _ = _attention_case(4, q_len=62, kv_len=62)
    want = kernels.flash_attention(q, k, v, causal=True, implementation="xla")
    mesh = engine.make_mesh(data=2, context=4)
    with jax.set_mesh(mesh):
        got = jax.jit(lambda *a: kernels.flash_attention(*a, causal=True, implementation="xla"))(q, k, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _llama_trainer(mesh, **options):
    model = models.create_model("llama", "tiny", scan_layers=True, remat="full", **options)
    params = models.init_params(model, jax.random.PRNGKey(0))
    return engine.Trainer(mesh=mesh, collate_fn=lm.collate_lm, loss_fn=lm.lm_loss_fn(model), params=params,
                          optimizer=optax.sgd(0.5))


def test_trainer_on_a_context_mesh_equals_the_run_without_it():
    """A packed LLaMA batch on data 2 x context 2 x model 2 (jit step) gives the losses and parameters of data 2 x
    model 2, and the weights are split over `context` as well (ZeRO-3 within each context group)."""
    rows = _packed_rows(16, seq=32)
    ref = _llama_trainer(engine.make_mesh(data=2, model=2, devices=jax.devices()[:4]))
    ref.fit(rows, per_device_batch_size=2, max_steps=2, log_every=1)
    got = _llama_trainer(engine.make_mesh(data=2, context=2, model=2))
    got.fit(rows, per_device_batch_size=2, max_steps=2, log_every=1)
    assert got._step_kind == "jit"
    np.testing.assert_allclose([h["loss"] for h in got.history], [h["loss"] for h in ref.history], rtol=1e-5)
    for x, y in zip(jax.tree.leaves(jax.device_get(ref.params)), jax.tree.leaves(jax.device_get(got.params))):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-6)
    specs = {engine.sharding.path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(
        got.param_specs, is_leaf=lambda s: isinstance(s, P))[0]}
    assert "context" in str(specs["layers/mlp/up/kernel"]) and "model" in str(specs["layers/mlp/up/kernel"])


def _assert_unsplit_gradients(loss_fn, params, batch, mesh):
    """Loss and every gradient of `loss_fn` with params on their auto_shard layout over `mesh` (rows over `data`)
    equal those without a mesh."""
    grads = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b, jax.random.key(0), False)[0]))
    want = grads(params, batch)
    placed = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), engine.auto_shard(params, mesh),
                                                 is_leaf=lambda s: isinstance(s, P)))
    with jax.set_mesh(mesh):
        got = grads(placed, jax.device_put(batch, NamedSharding(mesh, P("data"))))
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
    for (path, w), g in zip(jax.tree_util.tree_flatten_with_path(want[1])[0], jax.tree.leaves(got[1])):
        scale = max(float(np.abs(np.asarray(w)).max()), 1e-3)
        assert float(np.abs(np.asarray(g) - np.asarray(w)).max()) <= 1e-5 * scale, jax.tree_util.keystr(path)


def test_llama_with_triton_kernels_on_a_context_mesh_has_the_unsplit_gradients():
    """A scanned LLaMA with interpreted Triton attention and gated-MLP kernels: loss and every gradient on data 2 x
    context 2 x model 2 equal those without a mesh. Two rows per data position, the case where flattening the
    context-split tokens into kernel rows outside the kernel gave wrong gradients (kernels/matmul `_rows`)."""
    model = models.create_model("llama", "tiny", scan_layers=True, remat="full", attention_implementation="triton",
                                mlp_implementation="triton", kernel_interpret=True)
    params = models.init_params(model, jax.random.PRNGKey(0))
    tokens = np.random.RandomState(0).randint(0, 120, (4, 33)).astype(np.int32)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "segment_ids": np.ones((4, 32), np.int32)}
    _assert_unsplit_gradients(lm.lm_loss_fn(model), params, batch, engine.make_mesh(data=2, context=2, model=2))


def test_llama_on_a_context_mesh_beyond_its_heads_has_the_unsplit_gradients():
    """The tiny LLaMA's 4 query heads (2 kv heads) on context 8: 4 tokens per device, attention by ring; loss and
    every gradient equal those without a mesh."""
    model = models.create_model("llama", "tiny", scan_layers=True, remat="full")
    params = models.init_params(model, jax.random.PRNGKey(0))
    tokens = np.random.RandomState(0).randint(0, 120, (2, 33)).astype(np.int32)
    segments = np.repeat([[1, 2]], 16, axis=1).repeat(2, axis=0).astype(np.int32)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "segment_ids": segments}
    _assert_unsplit_gradients(lm.lm_loss_fn(model), params, batch, engine.make_mesh(data=1, context=8))


def _windowed_batch():
    """Two 32-token rows of two 16-token documents each: a window of 8 keys is shorter than every document."""
    tokens = np.random.RandomState(0).randint(0, 120, (2, 33)).astype(np.int32)
    segments = np.repeat([[1, 2]], 16, axis=1).repeat(2, axis=0).astype(np.int32)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "segment_ids": segments}


@pytest.mark.slow  # CI time: tests/test_sequence_parallel.py runs Gemma 2 on this mesh by default
@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_windowed_family_on_a_context_mesh_has_the_unsplit_gradients(family):
    """Sliding windows (the tiny configs' 8 keys; Gemma 2's local layers under the scanned lax.cond, its soft-caps)
    through Ulysses on data 2 x context 2 x model 2 (each device attends over whole rows of its heads): loss and
    every gradient equal those without a mesh."""
    model = models.create_model(family, "tiny", scan_layers=True, remat="full")
    params = models.init_params(model, jax.random.PRNGKey(0))
    _assert_unsplit_gradients(lm.lm_loss_fn(model), params, _windowed_batch(),
                              engine.make_mesh(data=2, context=2, model=2))


def test_a_windowed_family_beyond_its_heads_is_refused_in_one_line():
    """Context 8 over the tiny Mistral's 4 query heads would take ring attention, which has no windows: one
    ValueError line naming the window and what would run it."""
    model = models.create_model("mistral", "tiny", scan_layers=True)
    params = models.init_params(model, jax.random.PRNGKey(0))
    loss = lm.lm_loss_fn(model)
    with jax.set_mesh(engine.make_mesh(data=1, context=8)), pytest.raises(ValueError) as refusal:
        jax.jit(lambda p, b: loss(p, b, None, False)[0]).lower(params, _windowed_batch())
    assert str(refusal.value) == (  # (pytest's match would read JAX's note on its filtered traceback too)
        "flash_attention with window=(7, 0) on a mesh with context=8 whose 4 query heads per device do not divide by "
        "it (ring attention); expected window=None or query heads per device divisible by context")


def _trainer(family, mesh, step, loss_implementation=None, **options):
    model = models.create_model(family, "tiny", scan_layers=True, remat="full", **options)
    params = models.init_params(model, jax.random.PRNGKey(0))
    return engine.Trainer(mesh=mesh, collate_fn=lm.collate_lm, loss_fn=lm.lm_loss_fn(model, loss_implementation,
                                                                                      interpret=True),
                          params=params, optimizer=optax.sgd(0.5), parallelism=engine.Parallelism(step=step))


@pytest.mark.parametrize("family, mesh, options, loss_implementation", [
    pytest.param("llama", dict(data=2, context=2, model=2), {}, None,  # Ulysses, k / v through the all-to-all
                 marks=pytest.mark.slow),  # CI time: Mixtral's case below runs it on expert x context x model
    ("llama", dict(fsdp=2, context=4), {}, None),            # ZeRO-3 over fsdp and context; kv heads gathered
    pytest.param("llama", dict(context=8), {}, None, marks=pytest.mark.slow),  # ring: 4 heads on 8 devices
    pytest.param("llama", dict(data=2, context=2, model=2),  # kernels in a shard_map inside the step's
                 dict(attention_implementation="triton", mlp_implementation="triton", kernel_interpret=True,
                      sequence_parallel=True), "xla", marks=pytest.mark.slow),
    ("mixtral", dict(expert=2, context=2, model=2), {}, None),  # router losses' sums over context too
    pytest.param("gemma2", dict(data=2, context=2, model=2), {}, None, marks=pytest.mark.slow),  # windows, caps
    pytest.param("opt", dict(data=2, context=2, model=2), {}, None, marks=pytest.mark.slow),  # learned positions
    pytest.param("llama", dict(fsdp=2, context=2, model=2), dict(fp8=True, fp8_history=4), None,
                 marks=pytest.mark.slow),  # amaxes over the whole batch's tokens
    # A pipeline beside context: JAX 0.11 needs the manual context before the automatic stage in the mesh's order.
    pytest.param("llama", dict(fsdp=2, context=2, stage=2), dict(pipeline_microbatches=2), None,
                 marks=pytest.mark.slow),
])
def test_shard_map_step_on_a_context_mesh_equals_one_device(family, mesh, options, loss_implementation):
    """The shard_map step manual over `context` (each device its slice of every row's tokens: positions from the
    whole rows, attention's exchange in the step's manual region, the shards' losses weighted by their tokens):
    two SGD steps on packed rows with padding give one device's losses and parameters."""
    rows = _packed_rows(16, seq=32)
    ref = _trainer(family, engine.make_mesh(devices=jax.devices()[:1]), "jit", loss_implementation, **options)
    ref.fit(rows, per_device_batch_size=4, max_steps=2, log_every=1)
    got = _trainer(family, engine.make_mesh(**mesh), "shard_map", loss_implementation, **options)
    row_split = mesh.get("data", 1) * mesh.get("fsdp", 1) * mesh.get("expert", 1)
    got.fit(rows, per_device_batch_size=4 // row_split, max_steps=2, log_every=1)
    assert got._step_kind == "shard_map"
    np.testing.assert_allclose([h["loss"] for h in got.history], [h["loss"] for h in ref.history], rtol=1e-6)
    for x, y in zip(jax.tree.leaves(jax.device_get(ref.params)), jax.tree.leaves(jax.device_get(got.params))):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-6)


def test_shard_map_step_on_a_context_mesh_refuses_a_loss_that_sees_whole_rows():
    """A loss that does not say it runs on token slices (a user's, T5's) is refused in one line, so that nothing
    computed over a row's tokens (pooling, a sequence's log-probability) is silently taken over a slice."""
    model = models.create_model("t5", "tiny")
    for loss_fn in (lambda *a: 0.0, seq2seq.seq2seq_loss_fn(model)):
        with pytest.raises(ValueError, match=r"step='shard_map' on a mesh with context=2 with a loss_fn that does "
                                             r"not set token_parallel = True and a weight_metric"):
            engine.Trainer(mesh=engine.make_mesh(data=4, context=2), collate_fn=lm.collate_lm, loss_fn=loss_fn,
                           params={"w": jnp.zeros(2)}, optimizer=optax.sgd(0.1),
                           parallelism=engine.Parallelism(step="shard_map"))


@pytest.mark.parametrize("step", ["auto", "shard_map"])
def test_train_step_lowered_for_cuda_attends_over_whole_sequences_of_local_heads(step):
    """The Trainer's step for a Triton LLaMA on data 2 x context 2 x model 2, lowered for cuda: the attention kernel
    sees its row (2 rows / data 2), every token (32) of it and 1 of the 4 query heads (4 / model 2 / context 2),
    with the one kv head that head reads; in the jit step ('auto') and in the shard_map step (context manual)."""
    model = models.create_model("llama", "tiny", scan_layers=True, remat="full", attention_implementation="triton")
    params = jax.eval_shape(lambda: models.init_params(model, jax.random.PRNGKey(0)))
    trainer = engine.Trainer(mesh=engine.make_mesh(data=2, context=2, model=2), collate_fn=lm.collate_lm,
                             loss_fn=lm.lm_loss_fn(model), params=params, optimizer=optax.sgd(0.1),
                             parallelism=engine.Parallelism(step=step))
    operands = kernel_operands_of_train_step(trainer, 2, 32)
    attention = [t for t in operands if re.search(r"tensor<\d+x32x\d+x16x", t)]
    assert attention and all(re.findall(r"tensor<(\d+x\d+x\d+x16)x", t) == ["1x32x1x16"] * 3 for t in attention[:1])
    assert all(set(re.findall(r"tensor<(\d+x\d+x\d+x16)x", t)) == {"1x32x1x16"} for t in attention), attention


@pytest.mark.parametrize("step", ["auto", "shard_map"])
def test_train_step_lowered_for_cuda_runs_the_mlp_kernels_on_local_tokens(step):
    """The gated-MLP kernels of a Triton LLaMA's step on data 2 x context 2 x model 2, lowered for cuda, see their
    device's tokens only: 2 rows (4 / data 2) x 16 tokens (32 / context 2) = 32 rows of 64 features, and 64 of the
    128 hidden columns (model 2); whole rows would be 64. In the jit step ('auto') and in the shard_map step (where
    the batch itself enters split over `context`)."""
    # attention in plain XLA: lowered for an H200, its default would be the H200's kernel (a Triton call too)
    model = models.create_model("llama", "tiny", scan_layers=True, remat="full", mlp_implementation="triton",
                                attention_implementation="xla")
    params = jax.eval_shape(lambda: models.init_params(model, jax.random.PRNGKey(0)))
    trainer = engine.Trainer(mesh=engine.make_mesh(data=2, context=2, model=2), collate_fn=lm.collate_lm,
                             loss_fn=lm.lm_loss_fn(model), params=params, optimizer=optax.sgd(0.1),
                             parallelism=engine.Parallelism(step=step))
    operands = kernel_operands_of_train_step(trainer, 4, 32)
    assert len(operands) >= 3 and all(t.startswith("tensor<32x64xf32>, ") for t in operands), operands
    assert sum("tensor<64x64xf32>, tensor<64x64xf32>" in t for t in operands) >= 2, operands  # gate and up halves


@pytest.mark.slow  # CI time (~15 s); the LLaMA cases above run by default
def test_t5_on_a_context_mesh_has_the_unsplit_gradients():
    """T5: both stacks' tokens split over `context` (the biased self-attention left to the partitioner, the
    cross-attention of 8 decoder to 16 encoder tokens through the exchange); loss and gradients unchanged."""
    model = models.create_model("t5", "tiny")
    params = models.init_params(model, jax.random.PRNGKey(0))
    rng = np.random.RandomState(0)
    batch = {"input_ids": rng.randint(1, 100, (4, 16)), "attention_mask": np.ones((4, 16)),
             "decoder_input_ids": rng.randint(1, 100, (4, 8)), "decoder_attention_mask": np.ones((4, 8)),
             "labels": rng.randint(1, 100, (4, 8))}
    batch = {k: v.astype(np.int32) for k, v in batch.items()}
    _assert_unsplit_gradients(seq2seq.seq2seq_loss_fn(model), params, batch,
                              engine.make_mesh(data=2, context=2, model=2))


@pytest.mark.slow
def test_plan_of_a_context_mesh_compiles_in_bfloat16():
    """The jit step of a bf16 LLaMA planned on context 8 (the exchange's shard_map once made the size-1 `stage`
    axis manual, which aborted XLA:CPU's all-reduce promotion): it compiles, and the weights and optimizer state
    are split over the context group (ZeRO-3 over it)."""
    tiny = dict(model="llama", model_config="tiny", mesh="1,1,1", seq_len=16, step="jit", compute_dtype="bfloat16")
    split = planning.plan(num_devices=8, context=8, **tiny)
    assert split["context"] == 8 and split["collective_bytes"]["collective-permute"] > 0  # the ring: 4 heads
    # fp32 weights + two AdamW moments are 3x the weights' bytes unsplit, 3/8 of them split over 8.
    assert split["bytes"]["arguments"] < 0.5 * split["param_bytes"]


@pytest.mark.parametrize("step, mesh, options", [
    ("shard_map", dict(fsdp=2, context=4), {}),  # positions of each device's token slice without segment ids
    # ctx's None through the tick loop (rows over data only: JAX 0.11's XLA:CPU aborts beside an automatic fsdp)
    ("jit", dict(data=4, stage=2), dict(pipeline_microbatches=2)),
])
def test_whole_rows_without_segment_ids_train_as_rows_of_one_document(step, mesh, options):
    """Rows of tokens alone (`collate_lm` gives no segment ids, so attention takes none) train as the same rows
    with every token in segment 1 on one device: the same losses and parameters."""
    rng = np.random.default_rng(0)
    whole = [{"tokens": rng.integers(0, 120, 33).astype(np.int32)} for _ in range(16)]
    ones = [{**row, "segment_ids": np.ones(33, np.int32)} for row in whole]
    assert set(lm.collate_lm(whole[:2])) == {"input_ids", "labels"}
    ref = _trainer("llama", engine.make_mesh(devices=jax.devices()[:1]), "jit", **options)
    ref.fit(ones, per_device_batch_size=8, max_steps=2, log_every=1)
    got = _trainer("llama", engine.make_mesh(**mesh), step, **options)
    got.fit(whole, per_device_batch_size=8 // (mesh.get("data", 1) * mesh.get("fsdp", 1)), max_steps=2, log_every=1)
    assert got._step_kind == step
    np.testing.assert_allclose([h["loss"] for h in got.history], [h["loss"] for h in ref.history], rtol=1e-6)
    for x, y in zip(jax.tree.leaves(jax.device_get(ref.params)), jax.tree.leaves(jax.device_get(got.params))):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-6)
