"""engine.make_mesh, engine.auto_shard and engine.describe_sharding on the 8 simulated devices."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import engine
from tests import toy_models as tm

IDS = np.arange(16, dtype=np.int32).reshape(2, 8) % 64


def _init(module, *args):
    return jax.eval_shape(lambda: module.init(jax.random.key(0), *args)["params"])


def _flat(specs):
    return {"/".join(str(getattr(k, "key", k)) for k in p): s
            for p, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]}


def _check(specs, expected):
    """Every regex in `expected` matches at least one parameter, and all matched parameters have that spec."""
    flat = _flat(specs)
    for pattern, spec in expected.items():
        hits = {k: v for k, v in flat.items() if re.search(pattern, k)}
        assert hits, f"no parameter matches {pattern}: {sorted(flat)}"
        for k, v in hits.items():
            assert v == spec, f"{k}: got {v}, expected {spec}"


def _both_ways(module, *args, mesh=None):
    """Specs from the dataflow (trace_fn) and from names alone."""
    mesh = mesh or engine.make_mesh(data=2, model=4)
    params = _init(module, *args)
    traced = engine.auto_shard(params, mesh, trace_fn=lambda p: module.apply({"params": p}, *args))
    named = engine.auto_shard(params, mesh)
    return traced, named


# ---------------------------------------------------------------------------------------------------- make_mesh

def test_make_mesh_shapes_and_fill():
    assert engine.make_mesh().shape == {"stage": 1, "data": 8, "fsdp": 1, "context": 1, "model": 1, "expert": 1}
    m = engine.make_mesh(data=2, fsdp=-1, model=2)
    assert m.axis_names == ("data", "fsdp", "expert", "context", "stage", "model")
    assert dict(m.shape) == {"data": 2, "fsdp": 2, "stage": 1, "context": 1, "model": 2, "expert": 1}
    assert sorted(d.id for d in m.devices.flat) == list(range(8))
    sub = engine.make_mesh(data=1, model=4, devices=jax.devices()[:4])
    assert dict(sub.shape) == {"stage": 1, "data": 1, "fsdp": 1, "context": 1, "model": 4, "expert": 1}
    piped = engine.make_mesh(stage=2, model=2)
    assert dict(piped.shape) == {"data": 2, "fsdp": 1, "stage": 2, "context": 1, "model": 2, "expert": 1}
    # Placed stage-major: each stage a contiguous block of devices, the model pairs inside it.
    assert [sorted(d.id for d in piped.devices[:, :, :, :, s].flat) for s in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # context sits inside data, outside model: a context group is a contiguous block, model pairs within it.
    ctx = engine.make_mesh(data=2, context=2, model=2)
    assert dict(ctx.shape) == {"data": 2, "fsdp": 1, "stage": 1, "context": 2, "model": 2, "expert": 1}
    assert [sorted(d.id for d in ctx.devices[i].flat) for i in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [sorted(d.id for d in ctx.devices[0, 0, 0, c].flat) for c in range(2)] == [[0, 1], [2, 3]]
    # expert sits inside fsdp, outside model: an expert group's all-to-all stays within a data block.
    moe = engine.make_mesh(data=2, expert=2, model=2)
    assert dict(moe.shape) == {"data": 2, "fsdp": 1, "stage": 1, "context": 1, "model": 2, "expert": 2}
    assert [sorted(d.id for d in moe.devices[i].flat) for i in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [sorted(d.id for d in moe.devices[0, 0, e].flat) for e in range(2)] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("kwargs, message", [
    (dict(data=3, model=2), r"data=3 x fsdp=1 x model=2 = 6 devices, but 8 devices are available"),
    (dict(data=-1, model=3), r"8 devices cannot be split .*3 does not divide 8"),
    (dict(data=-1, fsdp=-1), r"only one axis size may be -1, got data=-1 and fsdp=-1"),
    (dict(data=0), r"data=0; expected a positive integer or -1"),
    (dict(model=-2), r"model=-2; expected a positive integer or -1"),
    (dict(data=2, context=3), r"data=2 x fsdp=1 x context=3 x model=1 = 6 devices"),
])
def test_make_mesh_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.make_mesh(**kwargs)


# ---------------------------------------------------------------------------------------------------- families

def test_llama_shaped_gqa():
    for specs in _both_ways(tm.LlamaLike(), IDS):
        _check(specs, {
            r"self_attn/(q|k|v)_proj/kernel": P(None, "model"),  # k/v: 2 kv heads x 8 = 16 columns, 4 | 16
            r"self_attn/o_proj/kernel": P("model"),
            r"mlp|gate_proj/kernel|up_proj/kernel": P(None, "model"),
            r"down_proj/kernel": P("model"),
            r"embed_tokens/embedding": P("model"),
            r"lm_head/kernel": P(None, "model"),
            r"norm/scale": P(),
        })


def test_gptj_shaped_parallel_block_and_biases():
    for specs in _both_ways(tm.GPTJLike(), IDS):
        _check(specs, {
            r"attn/(q|k|v)_proj/kernel": P(None, "model"),
            r"attn/out_proj/kernel": P("model"),
            r"mlp/fc_in/kernel": P(None, "model"),
            r"mlp/fc_in/bias": P("model"),  # follows its column-split layer
            r"mlp/fc_out/kernel": P("model"),
            r"mlp/fc_out/bias": P(),  # added after the all-reduce
            r"ln_1/(scale|bias)": P(),
            r"wte/embedding": P("model"),
            r"lm_head/kernel": P(None, "model"),
            r"lm_head/bias": P("model"),
        })


def test_opt_shaped_learned_positions_tied_head():
    for specs in _both_ways(tm.OPTLike(), IDS):
        _check(specs, {
            r"self_attn/(q|k|v)_proj/kernel": P(None, "model"),
            r"self_attn/(q|k|v)_proj/bias": P("model"),
            r"self_attn/out_proj/kernel": P("model"),
            r"self_attn/out_proj/bias": P(),
            r"layers_\d/fc1/kernel": P(None, "model"),
            r"layers_\d/fc2/kernel": P("model"),
            r"embed_tokens/embedding": P("model"),  # tied head: split once, on the vocabulary
            r"embed_positions/embedding": P(None, "model"),  # 66 positions: 4 does not divide; the hidden dim
        })


def test_t5_shaped_encoder_decoder():
    for specs in _both_ways(tm.T5Like(), IDS, IDS):
        _check(specs, {
            r"(SelfAttention|EncDecAttention)/(q|k|v)/kernel": P(None, "model"),
            r"(SelfAttention|EncDecAttention)/o/kernel": P("model"),
            r"DenseReluDense/wi/kernel": P(None, "model"),
            r"DenseReluDense/wo/kernel": P("model"),
            r"shared/embedding": P("model"),
            r"lm_head/kernel": P(None, "model"),
        })


def test_gpt2_shaped_where_alphabetical_order_fails():
    """RedCoast sorts names and makes c_fc row / c_proj column; the dataflow and the name table both get it right."""
    for specs in _both_ways(tm.GPT2Like(), IDS):
        _check(specs, {
            r"attn/c_attn/kernel": P(None, "model"),
            r"attn/c_attn/bias": P("model"),
            r"attn/c_proj/kernel": P("model"),
            r"attn/c_proj/bias": P(),
            r"mlp/c_fc/kernel": P(None, "model"),
            r"mlp/c_fc/bias": P("model"),
            r"mlp/c_proj/kernel": P("model"),
            r"wte/embedding": P("model"),
            r"ln_(1|2|f)/(scale|bias)": P(),
        })


def test_generic_mlp_stack_alternates_in_run_order():
    traced, named = _both_ways(tm.MLPStack(), jnp.ones((2, 32)))
    for specs in (traced, named):
        flat = _flat(specs)
        for i in range(8):
            want = P(None, "model") if i % 2 == 0 else P("model")
            assert flat[f"Dense_{i}/kernel"] == want, (i, flat[f"Dense_{i}/kernel"])
            assert flat[f"Dense_{i}/bias"] == (P("model") if i % 2 == 0 else P())


def test_generic_fused_qkv_attention():
    # `nn.Dense(d)(gelu(nn.Dense(4 * d)(x)))` constructs (and numbers) the outer layer first: Dense_2 runs last.
    traced, _ = _both_ways(tm.GenericFusedQKV(), jnp.ones((2, 8, 32)))
    _check(traced, {r"Dense_0/kernel": P(None, "model"), r"Dense_1/kernel": P("model"),
                    r"Dense_3/kernel": P(None, "model"), r"Dense_2/kernel": P("model"),
                    r"Dense_0/bias": P("model"), r"Dense_3/bias": P("model"), r"Dense_(1|2)/bias": P()})


def test_dataflow_beats_misleading_names():
    traced, named = _both_ways(tm.MisnamedMLP(), jnp.ones((2, 32)))
    _check(traced, {r"fc2/kernel": P(None, "model"), r"fc1/kernel": P("model")})  # fc2 runs first
    _check(named, {r"fc1/kernel": P(None, "model"), r"fc2/kernel": P("model")})  # names alone cannot know


def test_scan_over_layers_stacked_weights():
    module = tm.LlamaScanned()
    params = _init(module, IDS)
    specs = engine.auto_shard(params, engine.make_mesh(data=2, model=4),
                              trace_fn=lambda p: module.apply({"params": p}, IDS))
    _check(specs, {r"layers/block/self_attn/(q|k|v)_proj/kernel": P(None, None, "model"),
                   r"layers/block/self_attn/o_proj/kernel": P(None, "model"),
                   r"layers/block/(gate|up)_proj/kernel": P(None, None, "model"),
                   r"layers/block/down_proj/kernel": P(None, "model"),
                   r"layers/block/.*norm/scale": P()})


def test_odd_sizes_fall_back_then_replicate():
    # Dense_0: 32 -> 30 columns (4 does not divide 30) -> row split on its 32 inputs instead.
    # Dense_1: 30 -> 30: nothing divides -> replicated. Dense_2: 30 -> 32: column.
    traced, named = _both_ways(tm.MLPStack(widths=(32, 30, 30, 32)), jnp.ones((2, 32)))
    for specs in (traced, named):
        flat = _flat(specs)
        assert flat["Dense_0/kernel"] == P("model")
        assert flat["Dense_1/kernel"] == P()
        assert flat["Dense_0/bias"] == P() and flat["Dense_1/bias"] == P()


# ---------------------------------------------------------------------------------------------------- fsdp

def test_fsdp_splits_largest_remaining_dim():
    mesh = engine.make_mesh(data=1, fsdp=4, model=2)
    module = tm.LlamaLike()
    params = _init(module, IDS)
    specs = engine.auto_shard(params, mesh, trace_fn=lambda p: module.apply({"params": p}, IDS))
    _check(specs, {r"q_proj/kernel": P("fsdp", "model"),  # 32 x 32
                   r"down_proj/kernel": P("model", "fsdp"),  # 64 x 32: model took dim 0
                   r"embed_tokens/embedding": P("model", "fsdp"),
                   r"norm/scale": P()})  # under FSDP_MIN_ELEMENTS


def test_add_axis_keeps_tpu_shards_whole_tiles():
    """With a device tile (TPU: 8 x 128) the split leaves whole tiles where a dim allows it: LLaMA-7B's MLP kernel
    [4096, 11008] on 4 chips splits its rows (1024 x 11008), not into 2752 columns (XLA:TPU would all-reduce its
    gradient whole); where no dim keeps whole tiles, or without a tile (CPU, GPU), the largest dim as before."""
    sizes = {"fsdp": 4}
    assert engine.add_axis(P(), (4096, 11008), "fsdp", sizes) == P(None, "fsdp")
    assert engine.add_axis(P(), (4096, 11008), "fsdp", sizes, tile=(8, 128)) == P("fsdp")
    assert engine.add_axis(P(), (32, 4096, 11008), "fsdp", sizes, tile=(8, 128)) == P(None, "fsdp")
    assert engine.add_axis(P(), (11008, 4096), "fsdp", sizes, tile=(8, 128)) == P("fsdp")
    assert engine.add_axis(P(), (20, 100), "fsdp", sizes, tile=(8, 128)) == P(None, "fsdp")  # none whole: largest
    assert engine.sharding.device_tile(engine.make_mesh(data=1, fsdp=8)) is None  # these CPU devices


def test_add_axis_combines_when_no_free_dim_divides():
    sizes = {"data": 1, "fsdp": 4, "model": 2}
    assert engine.add_axis(P("model"), (64, 6), "fsdp", sizes, min_elements=0) == P(("model", "fsdp"))
    assert engine.add_axis(P("model"), (2, 6), "fsdp", sizes, min_elements=0) == P("model")  # nothing divides
    assert engine.add_axis(P(), (64, 128), "fsdp", sizes, min_elements=0) == P(None, "fsdp")
    assert engine.add_axis(P(), (64, 128), "fsdp", sizes) == P(None, "fsdp")
    assert engine.add_axis(P(), (8, 8), "fsdp", sizes) == P()  # below the size threshold


# ---------------------------------------------------------------------------------------------------- overrides

def test_rules_override_first_match_wins():
    mesh = engine.make_mesh(data=2, model=4)
    params = _init(tm.LlamaLike(), IDS)
    specs = engine.auto_shard(params, mesh, rules=[(r"lm_head", P()), (r"lm_head|embed", P(None, "model"))])
    _check(specs, {r"lm_head/kernel": P(), r"embed_tokens/embedding": P(None, "model"),
                   r"down_proj/kernel": P("model")})  # unmatched: automatic


@pytest.mark.parametrize("rules, message", [
    ([(r"lm_head", P("tensor"))], r"sharding rule 'lm_head' names mesh axis 'tensor' for parameter 'lm_head/kernel' "
                                  r"of shape \(32, 64\); the mesh has axes \('data', 'fsdp', 'expert', 'context', 'stage', 'model'\)"),
    ([(r"norm/scale", P("model"))], r"splits dim 0 \(size 32\)"),
    ([(r"down_proj", P(None, None, "model"))], r"3 entries for parameter 'layers_0/down_proj/kernel' of shape"),
    ([(r"mlp", "model")], r"rules: entry .*expected a \(regex string, PartitionSpec\) pair"),
    ([(r"(", P())], r"rules: regex '\(' does not compile"),
])
def test_rules_errors(rules, message):
    mesh = engine.make_mesh(data=1, model=8) if "size 32" in message else engine.make_mesh(data=2, model=4)
    params = _init(tm.LlamaLike(), IDS)
    if "size 32" in message:
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct((36,) if x.shape == (32,) else x.shape, x.dtype), params)
        message = r"splits dim 0 \(size 36\) of parameter 'layers_0/input_layernorm/scale' of shape \(36,\)"
        rules = [(r"input_layernorm/scale", P("model"))]
    with pytest.raises(ValueError, match=message):
        engine.auto_shard(params, mesh, rules=rules)


# ---------------------------------------------------------------------------------------------------- effect

def test_describe_sharding_bytes_per_device():
    mesh = engine.make_mesh(data=2, fsdp=2, model=2)
    module = tm.LlamaLike()
    params = _init(module, IDS)
    specs = engine.auto_shard(params, mesh, trace_fn=lambda p: module.apply({"params": p}, IDS))
    table = engine.describe_sharding(params, specs, mesh)
    row = next(line for line in table.splitlines() if line.startswith("layers_0/down_proj/kernel"))
    assert row.split()[-1] == str(64 * 32 * 4 // 4)  # P('model', 'fsdp') over 2 x 2 devices
    row = next(line for line in table.splitlines() if line.startswith("norm/scale"))
    assert row.split()[-1] == str(32 * 4)
    total = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(params))
    assert f"total: {total:,} bytes replicated" in table


def test_sharded_forward_matches_single_device():
    mesh = engine.make_mesh(data=2, fsdp=2, model=2)
    module = tm.GPT2Like()
    params = module.init(jax.random.key(1), IDS)["params"]
    specs = engine.auto_shard(params, mesh, trace_fn=lambda p: module.apply({"params": p}, IDS))
    sharded = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    assert sharded["h_0"]["mlp"]["c_fc"]["kernel"].sharding.spec == P("fsdp", "model")
    fwd = jax.jit(lambda p, ids: module.apply({"params": p}, ids))
    ids = np.tile(IDS, (2, 1))  # batch 4 over data x fsdp
    want = fwd(params, ids)
    got = fwd(sharded, jax.device_put(ids, NamedSharding(mesh, P(("data", "fsdp")))))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
