"""Mixture of experts (models/layers/moe.py, models/mixtral.py, models/qwen3_moe.py): the MoE layer against a dense
per-token loop (output and gradients), Mixtral and Qwen3-MoE against transformers on tiny random models (logits of
a left-padded batch and the load-balancing loss, greedy generation, checkpoint round trips), a Trainer step on
2x2x2 against one device, the router losses in the LM loss, the named real sizes."""
import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import engine
import models
from engine.tasks import lm
from kernels import axes
from models import layers
from tests.test_mistral import IDS, MASK, check_greedy_generate, check_round_trip, hf_builder
from tests import trainer_task as tt
from tests.test_qwen import train_adapters_only

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64)
_CONFIGS = {
    # top-2 of 4 experts of 32; a window of 4 inside the 16-token rows
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(TINY, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)),
    # layer 1 dense (mlp_only_layers), top-2 of 4 experts not renormalised (transformers' default)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(TINY, intermediate_size=96, moe_intermediate_size=32, head_dim=32, num_experts=4,
                       num_experts_per_tok=2, mlp_only_layers=[1])),
    "qwen3_moe-sparse": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                         dict(TINY, intermediate_size=96, moe_intermediate_size=32, head_dim=32, num_experts=4,
                              num_experts_per_tok=2, norm_topk_prob=True)),
}


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    return hf_builder(tmp_path_factory, _CONFIGS)


# ----------------------------------------------------------------------------------------------- the layer

def _dense_reference(layer, params, x, activation):
    """The MoE output token by token: each token through its top-k experts, weighted by their routing weights."""
    w = params["experts"]

    def one(token):
        probs = jax.nn.softmax(token @ params["router"]["kernel"])
        top, chosen = jax.lax.top_k(probs, layer.top_k)
        top = top / top.sum() if layer.norm_topk_prob else top
        y = jnp.zeros_like(token)
        for j in range(layer.top_k):
            gate, up, down = (w[name][chosen[j]] for name in ("gate", "up", "down"))
            y = y + top[j] * (activation(token @ gate) * (token @ up)) @ down
        return y

    return jax.vmap(one)(x.reshape(-1, x.shape[-1])).reshape(x.shape)


@pytest.mark.parametrize("norm_topk_prob", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_moe_layer_equals_a_dense_per_token_reference(norm_topk_prob):
    """Output and the gradients of x and of every weight (router included) within fp32 rounding of the loop over
    tokens; 3 x 5 tokens, top-2 of 4 experts (the sorted copies fall in ragged groups)."""
    layer = layers.MoE(num_experts=4, top_k=2, hidden=24, norm_topk_prob=norm_topk_prob, std=0.3)
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 5, 16))
    params = layer.init(jax.random.PRNGKey(0), x)["params"]
    r = jax.random.normal(jax.random.PRNGKey(2), x.shape)  # a random cotangent

    ours = lambda p, x: jnp.sum(layer.apply({"params": p}, x) * r)  # noqa: E731
    dense = lambda p, x: jnp.sum(_dense_reference(layer, p, x, jax.nn.silu) * r)  # noqa: E731
    np.testing.assert_allclose(layer.apply({"params": params}, x), _dense_reference(layer, params, x, jax.nn.silu),
                               atol=1e-5, rtol=1e-5)
    grads, want = jax.jit(jax.grad(ours, (0, 1)))(params, x), jax.jit(jax.grad(dense, (0, 1)))(params, x)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path))
    assert np.abs(np.asarray(grads[0]["router"]["kernel"])).max() > 1e-3  # the router is trained through the weights


@pytest.mark.parametrize("mesh", [pytest.param(dict(data=2, expert=4), marks=pytest.mark.slow),
                                  dict(fsdp=2, expert=2, model=2),
                                  pytest.param(dict(data=1, expert=8), marks=pytest.mark.slow)])
def test_expert_parallel_layer_equals_the_dense_reference_and_exchanges_by_all_to_all(mesh):
    """On a mesh with an `expert` axis (rows over the batch axes, the experts over `expert`, their hidden units over
    `model`) the layer's output and gradients equal the per-token loop, and its tokens travel by all-to-all on CPU
    (the padded exchange): one each way in the forward pass. 8 experts top-2, 16 x 3 tokens."""
    layer = layers.MoE(num_experts=8, top_k=2, hidden=16, std=0.3)
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 3, 8))
    params = layer.init(jax.random.PRNGKey(0), x)["params"]
    r = jax.random.normal(jax.random.PRNGKey(2), x.shape)
    mesh = engine.make_mesh(**mesh)
    specs = engine.auto_shard(params, mesh, trace_fn=lambda p: layer.apply({"params": p}, x))
    assert specs["experts"]["gate"][0] == "expert" and specs["experts"]["down"][0] == "expert"
    on_mesh = lambda tree, specs: jax.tree.map(  # noqa: E731
        lambda a, s: jax.device_put(a, jax.sharding.NamedSharding(mesh, s)), tree, specs)
    xs = on_mesh(x, jax.sharding.PartitionSpec(("data", "fsdp", "expert")))
    ours = lambda p, x: jnp.sum(layer.apply({"params": p}, x) * r)  # noqa: E731
    dense = lambda p, x: jnp.sum(_dense_reference(layer, p, x, jax.nn.silu) * r)  # noqa: E731
    with jax.set_mesh(mesh):
        forward = jax.jit(lambda p, x: layer.apply({"params": p}, x)).lower(on_mesh(params, specs), xs)
        np.testing.assert_allclose(forward.compile()(on_mesh(params, specs), xs),
                                   _dense_reference(layer, params, x, jax.nn.silu), atol=1e-5, rtol=1e-5)
        grads = jax.jit(jax.grad(ours, (0, 1)))(on_mesh(params, specs), xs)
    # on CPU the padded exchange: the tokens there and back, each with their output offsets; the counts gathered
    assert forward.as_text().count("all_to_all") == 4 and forward.as_text().count("ragged_all_to_all") == 0
    want = jax.jit(jax.grad(dense, (0, 1)))(params, x)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name, axis_index_groups=None):
    """`jax.lax.ragged_all_to_all` by its docstring's pseudocode, with ops XLA:CPU has (it has no ragged all-to-all):
    every device's operand, offsets and sizes all-gathered; each device writes, for each source and each of that
    source's slices addressed to it, recv_sizes rows of the source's operand from the slice's input offset at the
    slice's output offset. Rows read past the source's send size are NaN, so sizes that disagree show."""
    assert axis_index_groups is None
    ep, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    per_device = input_offsets.shape[0] // ep
    gather = lambda x: jax.lax.all_gather(x, axis_name)  # noqa: E731
    operands, starts, sizes, lands = map(gather, (operand, input_offsets, send_sizes, output_offsets))
    rows = jnp.arange(operand.shape[0])
    result = output
    for source in range(ep):
        for i in range(per_device):
            slot = me * per_device + i  # the source's slice i addressed to this device
            start, sent, land = starts[source, slot], sizes[source, slot], lands[source, slot]
            count = recv_sizes[source * per_device + i]
            values = operands[source][jnp.clip(start + rows, 0, operand.shape[0] - 1)]
            values = jnp.where((rows < sent).reshape(-1, *[1] * (operand.ndim - 1)), values, jnp.nan)
            result = result.at[jnp.where(rows < count, land + rows, output.shape[0])].set(values, mode="drop")
    return result


@pytest.fixture
def emulated_ragged_lowering(monkeypatch):
    """XLA:CPU runs `jax.lax.ragged_all_to_all` through `_emulated_ragged_all_to_all` for the test (the primitive and
    JAX's rules for its gradient stay; only its CPU lowering is the emulation): yields the list of lowered calls."""
    from jax._src import core  # the axis environment of a lowering rule's trace
    from jax._src.interpreters import mlir  # the per-platform lowering table, to put back what was there
    from jax._src.lax.parallel import ragged_all_to_all_p
    calls = []

    def lowering(ctx, *args, axis_name, axis_index_groups):
        calls.append(ctx.avals_in[0].shape)
        names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
        with core.extend_axis_env_nd([(n, ctx.module_context.axis_context.mesh.shape[n]) for n in names]):
            return mlir.lower_fun(functools.partial(_emulated_ragged_all_to_all, axis_name=axis_name,
                                                    axis_index_groups=axis_index_groups), False)(ctx, *args)

    monkeypatch.setitem(mlir._platform_specific_lowerings["cpu"], ragged_all_to_all_p,
                        mlir.LoweringRuleEntry(lowering, False))
    yield calls


def test_ragged_exchanges_give_the_documented_example(emulated_ragged_lowering):
    """`jax.lax.ragged_all_to_all`'s docstring example over an axis of 2 (operands [1, 2, 2] and [3, 4, 0], results
    [1, 3, 0, 0] and [2, 2, 4, 0]), and the gradient of the operands under the weights 0 ... 7 of the results' rows,
    from the emulation (test_moe's CPU lowering of the primitive) and from moe's padded exchange (CPU's)."""
    from models.layers import moe
    mesh = jax.make_mesh((2,), (axes.EXPERT,), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,))
    args = [np.array(a, dtype) for a, dtype in [
        ([1, 2, 2, 3, 4, 0], np.float32), ([0, 0, 0, 0] * 2, np.float32),  # operand, output
        ([0, 1, 0, 1], np.int32), ([1, 2, 1, 1], np.int32),  # input_offsets, send_sizes
        ([0, 0, 1, 2], np.int32), ([1, 1, 2, 1], np.int32)]]  # output_offsets, recv_sizes
    exchanges = {"ragged": functools.partial(jax.lax.ragged_all_to_all, axis_name=axes.EXPERT),
                 "padded": functools.partial(moe._padded_exchange, axis_name=axes.EXPERT, capacity=2)}
    for name, exchange in exchanges.items():
        run = jax.shard_map(exchange, mesh=mesh, in_specs=P(axes.EXPERT), out_specs=P(axes.EXPERT),
                            check_vma=False)
        np.testing.assert_array_equal(jax.jit(run)(*args), [1, 3, 0, 0, 2, 2, 4, 0], err_msg=name)
        grad = jax.jit(jax.grad(lambda operand, *rest: jnp.sum(run(operand, *rest) * jnp.arange(8.0))))(*args)
        # operand 0's 1 -> result 0 row 0; its 2, 2 -> result 1 rows 0, 1; operand 1's 3 -> result 0 row 1, 4 ->
        # result 1 row 2, 0 not sent
        np.testing.assert_array_equal(grad, [0, 4, 5, 1, 6, 0], err_msg=name)
    assert len(emulated_ragged_lowering) == 2  # the forward, the gradient's transpose


@pytest.mark.parametrize("mesh", [dict(fsdp=2, expert=4),
                                  pytest.param(dict(fsdp=2, expert=2, model=2), marks=pytest.mark.slow),
                                  pytest.param(dict(data=1, expert=8), marks=pytest.mark.slow)])
def test_ragged_expert_exchange_equals_the_dense_reference(mesh, emulated_ragged_lowering):
    """The ragged exchange (GPU's and TPU's; expert_exchange='ragged') run on CPU with `jax.lax.ragged_all_to_all`
    lowered to the test's emulation: its offsets and sizes both ways, and JAX's transposes of them, give the
    per-token loop's output and gradients (two experts a device on expert 4, their hidden units over model 2 too;
    one on expert 8)."""
    layer = layers.MoE(num_experts=8, top_k=2, hidden=16, std=0.3, expert_exchange="ragged")
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 3, 8))
    params = layer.init(jax.random.PRNGKey(0), x)["params"]
    r = jax.random.normal(jax.random.PRNGKey(2), x.shape)
    mesh = engine.make_mesh(**mesh)
    specs = engine.auto_shard(params, mesh, trace_fn=lambda p: layer.apply({"params": p}, x))
    on_mesh = lambda tree, specs: jax.tree.map(  # noqa: E731
        lambda a, s: jax.device_put(a, jax.sharding.NamedSharding(mesh, s)), tree, specs)
    xs = on_mesh(x, P(("data", "fsdp", "expert")))
    dense = lambda p, x: jnp.sum(_dense_reference(layer, p, x, jax.nn.silu) * r)  # noqa: E731

    def output_and_grads(p, x):  # one program: the forward and the cotangent r pulled back
        out, pull_back = jax.vjp(lambda p, x: layer.apply({"params": p}, x), p, x)
        return out, pull_back(r)
    with jax.set_mesh(mesh):
        got, grads = jax.jit(output_and_grads)(on_mesh(params, specs), xs)
        program = str(jax.make_jaxpr(output_and_grads)(on_mesh(params, specs), xs))
    assert program.count(" ragged_all_to_all[") == 4  # there and back, and the transposes of both
    assert emulated_ragged_lowering  # run by the emulation
    np.testing.assert_allclose(got, _dense_reference(layer, params, x, jax.nn.silu), atol=1e-5, rtol=1e-5)
    want = jax.jit(jax.grad(dense, (0, 1)))(params, x)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def _lowered_expert_layer(mesh, platform, exchange=None, features=8):
    """The MoE layer's forward and backward on `mesh` lowered for `platform` (abstract arguments) -> StableHLO."""
    layer = layers.MoE(num_experts=8, top_k=2, hidden=16, std=0.3, implementation="xla", expert_exchange=exchange)
    x = jnp.zeros((16, 3, features))
    params = jax.eval_shape(lambda: layer.init(jax.random.PRNGKey(0), x)["params"])
    specs = engine.auto_shard(params, mesh, trace_fn=lambda p: layer.apply({"params": p}, x))
    typed = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.NamedSharding(mesh, s))  # noqa
    loss = lambda p, x: jnp.sum(layer.apply({"params": p}, x) ** 2)  # noqa: E731
    with jax.set_mesh(mesh):
        traced = jax.jit(jax.grad(loss, (0, 1))).trace(jax.tree.map(typed, params, specs),
                                                       typed(x, P(("data", "fsdp", "expert"))))
        return traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()


def _all_to_all_operand_types(text):
    return re.findall(r'"stablehlo\.all_to_all"\(.*: \((tensor<[^>]*>)\)', text)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_expert_exchange_is_ragged_when_lowered_for_gpu_and_tpu(platform):
    """The default exchange, lowered from this CPU host for cuda or tpu: four ragged all-to-alls (the tokens there and
    back, and their transposes) and no padded all-to-all of rows (only int32 offsets: the transposes'); lowered for
    cpu the padded one; expert_exchange='padded' forces it anywhere."""
    mesh = engine.make_mesh(fsdp=2, expert=2, model=2)
    text = _lowered_expert_layer(mesh, platform).as_text()
    assert text.count("@ragged_all_to_all") == 4
    operands = _all_to_all_operand_types(text)
    assert operands and all(t.endswith("xi32>") for t in operands), operands
    cpu = _lowered_expert_layer(mesh, None).as_text()
    assert "ragged_all_to_all" not in cpu and any(t.endswith("xf32>") for t in _all_to_all_operand_types(cpu))
    forced = _lowered_expert_layer(mesh, platform, exchange="padded").as_text()
    assert "ragged_all_to_all" not in forced


def test_plan_counts_a_ragged_all_to_all_at_the_routed_rows():
    """A ragged all-to-all of 24 routed rows (operand) into a 96-row receive buffer, and the outputs' 96-row buffer
    back into 24 rows: each counted as the 24 rows' bytes x (n-1)/n over its group of 4."""
    from engine import plan
    hlo = """HloModule m

ENTRY %main (a: bf16[24,256], b: bf16[96,256]) -> bf16[24,256] {
  %a = bf16[24,256]{1,0} parameter(0)
  %b = bf16[96,256]{1,0} parameter(1)
  %r1 = bf16[96,256]{1,0} ragged-all-to-all(%a, %z1, %o1, %s1, %p1, %q1), channel_id=1, replica_groups={{0,1,2,3}}
  ROOT %r2 = bf16[24,256]{1,0} ragged-all-to-all(%b, %z2, %o2, %s2, %p2, %q2), channel_id=2, replica_groups={{0,1,2,3}}
}
"""
    assert plan.collective_bytes(hlo, num_devices=4)["ragged-all-to-all"] == 2 * 24 * 256 * 2 * 3 // 4


@pytest.mark.tpu
def test_ragged_expert_exchange_compiles_for_tpu_and_plans_the_routed_rows():
    """XLA:TPU (libtpu's compile-only v5p-8) compiles the layer's forward and backward with the ragged exchange
    over expert=4: four ragged all-to-alls, counted at the routed rows (12 tokens x top-2 a device, rows of 256)
    per direction, at most a quarter of what the padded exchange sends."""
    from engine import plan
    from tests.tpu_targets import tpu_devices
    mesh = engine.make_mesh(expert=4, devices=tpu_devices("v5p"))
    ragged = _lowered_expert_layer(mesh, None, features=256).compile().as_text()
    # XLA:TPU sends the rows the default-precision matmuls read as bf16 (they round them so), the rest as f32
    dtypes = re.findall(r"= (bf16|f32)\[[\d,]+\]\S* ragged-all-to-all\(", ragged)
    assert len(dtypes) == 4
    sent = plan.collective_bytes(ragged, num_devices=4)
    assert sent["ragged-all-to-all"] == sum(24 * 256 * {"bf16": 2, "f32": 4}[d] * 3 // 4 for d in dtypes)
    padded = plan.collective_bytes(_lowered_expert_layer(mesh, None, "padded", features=256).compile().as_text(), 4)
    assert padded["ragged-all-to-all"] == 0 and padded["all-to-all"] >= 4 * sent["ragged-all-to-all"]


def test_auto_shard_splits_the_experts_over_expert_from_the_dataflow():
    """The weights the traced program hands to `kernels.grouped_matmul` are split over `expert` along their group
    dim, whatever their names; over `model` gate and up are column-split and down row-split along the hidden units
    (Megatron's pair), the rest of the model as before."""
    model = models.create_model("mixtral", "tiny", scan_layers=True)
    params = jax.eval_shape(lambda: models.init_params(model, jax.random.PRNGKey(0)))
    batch = lm.collate_lm([{"tokens": np.arange(3, 20, dtype=np.int32), "segment_ids": np.ones(17, np.int32)}] * 4)
    trace = lambda p: lm.lm_loss_fn(model)(p, batch, None, True)  # noqa: E731
    P = jax.sharding.PartitionSpec
    specs = engine.auto_shard(params, engine.make_mesh(data=1, fsdp=2, expert=2, model=2), trace_fn=trace)
    experts = specs["layers"]["mlp"]["experts"]
    assert (experts["gate"], experts["up"], experts["down"]) == (
        P(None, "expert", "fsdp", "model"), P(None, "expert", "fsdp", "model"), P(None, "expert", "model", "fsdp"))
    assert specs["layers"]["attn"]["q"]["kernel"] == P(None, "fsdp", "model")
    renamed = {**params, "layers": {**params["layers"], "mlp": {**params["layers"]["mlp"]}}}
    with pytest.raises(ValueError, match=r"a mesh with expert=2 needs trace_fn .*got trace_fn=None"):
        engine.auto_shard(renamed, engine.make_mesh(data=4, expert=2))


@pytest.mark.parametrize("mesh, step, remat", [
    pytest.param(dict(data=2, expert=4), "jit", "none", marks=pytest.mark.slow),
    pytest.param(dict(fsdp=2, expert=2, model=2), "jit", "none", marks=pytest.mark.slow),
    pytest.param(dict(data=2, fsdp=2, expert=2), "shard_map", "none", marks=pytest.mark.slow),
    (dict(fsdp=2, expert=4), "shard_map", "full")])
def test_expert_parallel_trainer_step_equals_one_device(mesh, step, remat):
    """One SGD step of the tiny Mixtral through the Trainer on an expert-parallel mesh equals the step on one device
    (loss, both router losses, every updated weight); the experts stay split over `expert`. remat='full': the
    shard_map step's hand-pipelined layer stack, its fsdp gathers and reduce-scatters block by block over `expert`.
    The load-balancing loss weighs 0.5 (25x Mixtral's): the shard_map step sums the router statistics over its
    manual axes before the loss, so its gradient is the global batch's too."""
    model = models.create_model("mixtral", "tiny", scan_layers=True, remat=remat, router_aux_loss_coef=0.5,
                                router_z_loss_coef=1e-2)
    params = models.init_params(model, jax.random.PRNGKey(0))
    trainer, _ = tt.assert_sgd_step_equals_one_device(model, params, tt.lm_rows(8), engine.make_mesh(**mesh), step)
    assert trainer.params["layers"]["mlp"]["experts"]["gate"].sharding.spec[1] == "expert"


@pytest.mark.slow
def test_plan_of_an_expert_mesh_holds_a_share_of_the_experts_and_sends_tokens_by_all_to_all():
    """`plan` on data 2 x expert 4 against data 8: the arguments (weights and optimizer state) shrink by the
    experts' three quarters, the step sends all-to-all bytes over `expert` and none without it; fsdp 2 x expert 4
    gathers less than half what fsdp 8 does."""
    from engine.tasks import planning
    common = dict(model="mixtral", model_config="tiny", num_devices=8, seq_len=64)
    dense, split = planning.plan(mesh="8,1,1", **common), planning.plan(mesh="2,1,1,4", **common)
    # beside fsdp the experts are gathered block by block over `expert`, never whole (engine/step/shards.py)
    fsdp, both = planning.plan(mesh="1,8,1", **common), planning.plan(mesh="1,2,1,4", **common)
    assert both["collective_bytes"]["all-gather"] < 0.5 * fsdp["collective_bytes"]["all-gather"]
    assert split["mesh"] == [2, 1, 1, 4] and dense["mesh"] == [8, 1, 1]
    assert dense["collective_bytes"]["all-to-all"] == 0 < split["collective_bytes"]["all-to-all"]
    assert split["bytes_by_axes"]["expert"] > 0
    model = models.create_model("mixtral", "tiny")
    experts = sum(x.size for x in jax.tree.leaves(jax.eval_shape(lambda: models.init_params(
        model, jax.random.PRNGKey(0)))["layers_0"]["mlp"]["experts"])) * model.config.num_layers
    # fp32 weights + two Adam moments: 12 bytes per parameter, the experts' held 1/4 of them
    saved = dense["bytes"]["arguments"] - split["bytes"]["arguments"]
    assert saved == pytest.approx(12 * experts * 3 / 4, rel=0.02)


def test_train_flops_count_the_experts_a_token_passes_through():
    """Mixtral's model FLOPs are a dense model's with k of the E experts' MLP per token (the router a [D, E] matmul):
    6 x tokens x (attention and head weights + router + k x one expert) + attention, as models.flops counts a LLaMA."""
    moe = models.create_model("mixtral", "tiny", num_layers=2)
    c = moe.config
    F = c.moe_intermediate_size or c.intermediate_size
    dense = models.create_model("llama", "tiny", num_layers=2, hidden_size=c.hidden_size, num_heads=c.num_heads,
                                num_kv_heads=c.kv_heads, vocab_size=c.vocab_size,
                                intermediate_size=F * c.num_experts_per_tok)
    router = 6 * 16 * c.num_layers * c.hidden_size * c.num_experts
    assert models.train_flops_per_example(moe, 16) == pytest.approx(models.train_flops_per_example(dense, 16) + router)


@pytest.mark.parametrize("fmt, tolerance", [("int8", 0.02), ("nf4", 0.25)])
def test_quantized_experts_are_close_to_float_and_load_quantised_as_read(hf_checkpoint, fmt, tolerance):
    """A mixture's stacked experts stored as int8 / nf4 with a scale per expert (`models.quantize`, as its
    projections): logits within `tolerance` of the float model's largest; dequantize gives back float experts; a
    transformers directory read with quantize='int8' holds what quantising the float read gives (nf4 needs rows in
    blocks of 64: a model of 128-wide experts, not read)."""
    if fmt == "int8":
        _, path = hf_checkpoint("mixtral")
        model, params = models.load_pretrained(path, scan_layers=True)
    else:
        model = models.create_model("mixtral", "tiny", scan_layers=True, hidden_size=128, intermediate_size=128)
        params = models.init_params(model, jax.random.PRNGKey(0))
    qmodel, qparams = models.quantize(model, params, fmt)
    experts = qparams["layers"]["mlp"]["experts"]
    assert experts["gate"].dtype == (jnp.int8 if fmt == "int8" else jnp.uint8) and "gate_scale" in experts
    ids = jnp.asarray(IDS)
    ref = model.apply({"params": params}, ids)
    assert float(jnp.abs(qmodel.apply({"params": qparams}, ids) - ref).max()) < tolerance * float(jnp.abs(ref).max())
    _, back = models.dequantize(qmodel, qparams)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    if fmt == "int8":
        _, read = models.load_pretrained(path, scan_layers=True, quantize=fmt)
        for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(read)[0], jax.tree.leaves(qparams)):
            # quantised on the host as read, on the device by `quantize`: scales within float32 rounding, codes
            # within 1
            codes = jnp.issubdtype(a.dtype, jnp.integer)
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=0 if codes else 1e-6,
                                       atol=1.0 if codes else 0, err_msg=jax.tree_util.keystr(p))


def test_lora_on_the_experts_merges_exactly_and_is_split_with_them():
    """LoRA pairs per expert (`experts/lora/<name>/lora_a|b`, gate / up / down adapted by default): the adapted model
    equals its merge (x W + x A B alpha / r, expert by expert); on fsdp 2 x expert 2 x model 2 the pairs follow their
    stack (expert dim; over `model` B of gate / up by columns and A of down by rows) and the output is unchanged;
    PEFT export and adapter dropout refuse expert pairs in one line."""
    model = models.create_model("mixtral", "tiny", scan_layers=True, lora_rank=4)
    params = models.add_lora(model, models.init_params(models.create_model("mixtral", "tiny", scan_layers=True),
                                                       jax.random.PRNGKey(0)))
    pairs = params["layers"]["mlp"]["experts"]["lora"]
    assert sorted(pairs) == ["down", "gate", "up"] and pairs["gate"]["lora_a"].shape == (2, 4, 64, 4)
    params = jax.tree_util.tree_map_with_path(  # B at random: the adapters change the output
        lambda p, x: 0.1 * jax.random.normal(jax.random.PRNGKey(3), x.shape) if "lora_b" in jax.tree_util.keystr(p)
        else x, params)
    ids = jnp.asarray(np.random.RandomState(0).randint(3, 120, (8, 16)), jnp.int32)
    out = model.apply({"params": params}, ids)
    merged_model, merged = models.merge_lora(model, params)
    base = models.create_model("mixtral", "tiny", scan_layers=True)
    plain = base.apply({"params": models.init_params(base, jax.random.PRNGKey(0))}, ids)
    assert float(jnp.abs(plain - out).max()) > 1e-3
    np.testing.assert_allclose(merged_model.apply({"params": merged}, ids), out, atol=1e-5)
    mesh = engine.make_mesh(fsdp=2, expert=2, model=2)
    batch = lm.collate_lm([{"tokens": np.arange(3, 20, dtype=np.int32), "segment_ids": np.ones(17, np.int32)}] * 8)
    specs = engine.auto_shard(params, mesh, trace_fn=lambda p: lm.lm_loss_fn(model)(p, batch, None, True))
    spec = specs["layers"]["mlp"]["experts"]["lora"]
    assert spec["gate"]["lora_b"][1] == spec["down"]["lora_a"][1] == "expert"
    assert spec["gate"]["lora_b"][3] == spec["down"]["lora_a"][2] == "model"
    placed = jax.tree.map(lambda a, s: jax.device_put(a, jax.sharding.NamedSharding(mesh, s)), params, specs)
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(jax.jit(lambda p: model.apply({"params": p}, ids))(placed), out, atol=1e-5)
    with pytest.raises(ValueError, match=r"LoRA pairs on a mixture's experts, which this PEFT export does not write"):
        models.save_lora_adapter(model, params, "/nonexistent")
    with pytest.raises(ValueError, match=r"lora_dropout=0.1 with LoRA on the experts \(down, gate, up in "):
        models.create_model("mixtral", "tiny", lora_rank=4, lora_dropout=0.1)


def test_lora_on_an_int8_mixture_on_an_expert_mesh_trains_the_adapters_alone():
    """QLoRA on a mixture: int8 experts and projections, adapters on the attention and on every expert, on data 1 x
    fsdp 2 x expert 2 x model 2 (each expert's int8 codes, scales and pairs split over `expert`): the loss falls and
    only adapters move."""
    mesh = engine.make_mesh(fsdp=2, expert=2, model=2)
    model = models.create_model("mixtral", "tiny", scan_layers=True, lora_rank=4)
    params = models.add_lora(model, models.init_params(models.create_model("mixtral", "tiny", scan_layers=True),
                                                       jax.random.PRNGKey(0)))
    model, params = models.quantize(model, params, "int8")
    experts = train_adapters_only(model, params, mesh, rows=32, steps=4, drop=0.1).params["layers"]["mlp"]["experts"]
    assert experts["gate"].dtype == jnp.int8 and experts["gate_scale"].sharding.spec[1] == "expert"
    assert experts["lora"]["up"]["lora_a"].sharding.spec[1] == "expert"


@pytest.mark.slow  # CI time (12 s)
def test_dpo_and_grpo_losses_add_the_router_losses():
    """The DPO and PPO / GRPO losses of a mixture-of-experts policy add its router losses with the config's weights,
    as the LM loss does: the loss with router_aux_loss_coef=0.5 is the one with 0 plus half the reported term."""
    from engine.tasks.rlhf import ppo, preference
    rng = np.random.RandomState(0)
    ids = rng.randint(3, 120, (2, 2, 12)).astype(np.int32)
    labels = np.where(np.arange(12) >= 6, ids, -100).astype(np.int32)
    pairs = {"input_ids": ids, "segment_ids": np.ones_like(ids), "labels": labels,
             "ref_log_probs": rng.randn(2, 2).astype(np.float32)}
    rows = {k: v.reshape(4, 12) for k, v in pairs.items() if k != "ref_log_probs"}
    rows.update(old_log_probs=np.zeros((4, 12), np.float32), ref_log_probs=np.zeros((4, 12), np.float32),
                advantages=rng.randn(4, 12).astype(np.float32))
    for loss_of in (lambda m: preference.dpo_loss_fn(m)(params, pairs, None, False),
                    lambda m: ppo.ppo_loss_fn(m, None)({"actor": params}, rows, None, False)):
        losses = {}
        for coef in (0.0, 0.5):
            model = models.create_model("mixtral", "tiny", router_aux_loss_coef=coef)
            params = models.init_params(model, jax.random.PRNGKey(0))
            losses[coef] = loss_of(model)
        (plain, metrics), (weighted, _) = losses[0.0], losses[0.5]
        assert metrics["load_balancing_loss"] > 1.0
        assert float(weighted) == pytest.approx(float(plain) + 0.5 * float(metrics["load_balancing_loss"]), rel=1e-5)


def test_a_sharded_checkpoint_streams_onto_an_expert_mesh(hf_checkpoint, tmp_path):
    """Mixtral saved in 64 KiB safetensors shards (an index) and read with `auto_layout` of fsdp 2 x expert 2 x model
    2: every tensor lands on its shard (the experts over `expert`) and equals the unsharded read."""
    model, params = models.load_pretrained(hf_checkpoint("mixtral")[1], scan_layers=True)
    models.save_pretrained(model, params, str(tmp_path), max_shard_bytes=64 * 1024)
    assert (tmp_path / "model.safetensors.index.json").exists()
    mesh = engine.make_mesh(fsdp=2, expert=2, model=2)
    _, placed = models.load_pretrained(str(tmp_path), scan_layers=True, layout=engine.auto_layout(mesh))
    assert placed["layers"]["mlp"]["experts"]["gate"].sharding.spec[1] == "expert"
    for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(placed)[0], jax.tree.leaves(params)):
        np.testing.assert_array_equal(jax.device_get(a), b, err_msg=jax.tree_util.keystr(p))


def test_router_losses_of_uniform_and_collapsed_routers():
    """A router with zero logits balances perfectly (load balancing k, z-loss log(E)^2); one that sends every token
    to the same experts is penalised (E / k times more); padding tokens do not count."""
    layer = layers.MoE(num_experts=4, top_k=2, hidden=8)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 16))
    params = layer.init(jax.random.PRNGKey(0), x)["params"]

    @jax.jit
    def router_losses(router, valid):
        _, state = layer.apply({"params": {**params, "router": {"kernel": router}}}, x, valid,
                               mutable=["intermediates"])
        return layers.router_losses(state["intermediates"])

    def losses(router, valid=jnp.ones((2, 6), bool)):
        return [float(v) for v in router_losses(router, valid)]

    balance, z = losses(jnp.zeros((16, 4)))
    assert balance == pytest.approx(2.0, abs=1e-6) and z == pytest.approx(np.log(4) ** 2, rel=1e-6)
    collapsed = jnp.zeros((16, 4)).at[:, :2].set(1e3 * jnp.sign(x[0, 0])[:, None])  # experts 0, 1 for x[0, 0]
    valid = jnp.zeros((2, 6), bool).at[0, 0].set(True)
    assert losses(collapsed, valid)[0] == pytest.approx(4.0, rel=1e-5)


def test_router_losses_in_a_shard_map_over_batch_axes_are_the_whole_batchs():
    """Inside a shard_map manual over `data` and `fsdp` (as the engine's shard_map step runs the loss on each device's
    rows) the router statistics are summed over those axes before the losses: each device's terms and the gradient
    of their mean equal the whole batch's on one device, where per-device losses would not."""
    layer = layers.MoE(num_experts=4, top_k=2, hidden=8)
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 6, 16))
    params = layer.init(jax.random.PRNGKey(0), x)["params"]
    valid = jnp.arange(6)[None, :] >= jnp.arange(8)[:, None] % 3  # rows with different numbers of valid tokens

    def losses(router, x, valid):
        _, state = layer.apply({"params": {**params, "router": {"kernel": router}}}, x, valid,
                               mutable=["intermediates"])
        return jnp.stack(layers.router_losses(state["intermediates"]))

    mesh = engine.make_mesh(data=4, fsdp=2)
    rows = P((axes.DATA, axes.FSDP))

    def mean_of_devices(router, x, valid):
        each = jax.shard_map(lambda r, x, v: losses(r, x, v)[None], mesh=mesh, in_specs=(P(), rows, rows),
                             out_specs=rows, axis_names={axes.DATA, axes.FSDP}, check_vma=False)(router, x, valid)
        return each, each.mean(0)

    router = params["router"]["kernel"]
    whole = jax.jit(losses)(router, x, valid)
    each, _ = jax.jit(mean_of_devices)(router, x, valid)
    np.testing.assert_allclose(each, np.broadcast_to(whole, each.shape), rtol=1e-6)
    per_device = [losses(router, x[i:i + 1], valid[i:i + 1]) for i in range(8)]
    assert abs(float(np.mean([p[0] for p in per_device])) - float(whole[0])) > 1e-3  # what summing first changes
    weights = jnp.array([1.0, 0.1])
    whole_grad = jax.jit(jax.grad(lambda r: losses(r, x, valid) @ weights))(router)
    split_grad = jax.jit(jax.grad(lambda r: mean_of_devices(r, x, valid)[1] @ weights))(router)
    np.testing.assert_allclose(split_grad, whole_grad, rtol=1e-5, atol=1e-7)


def test_lm_loss_adds_the_router_losses_with_the_config_weights():
    model = models.create_model("mixtral", "tiny", num_layers=1, router_aux_loss_coef=0.5, router_z_loss_coef=0.25)
    params = models.init_params(model, jax.random.PRNGKey(0))
    batch = lm.collate_lm([{"tokens": np.arange(3, 20, dtype=np.int32), "segment_ids": np.ones(17, np.int32)}] * 2)
    loss, metrics = jax.jit(lm.lm_loss_fn(model), static_argnums=(2, 3))(params, batch, None, False)
    logits = jax.jit(model.apply)({"params": params}, batch["input_ids"], batch["segment_ids"])
    plain = lm.loss_and_metrics(model, params, logits, batch["labels"], None, False)[0]  # the cross-entropy
    assert float(loss) == pytest.approx(float(plain) + 0.5 * float(metrics["load_balancing_loss"])
                                        + 0.25 * float(metrics["router_z_loss"]), rel=1e-6)
    assert metrics["load_balancing_loss"] >= 2.0 - 1e-5  # k, for a perfectly balanced router


# ----------------------------------------------------------------------------------------------- the families

def _hf_aux_loss(hf_model):
    import torch

    positions = np.maximum(np.cumsum(MASK, 1) - 1, 0)
    with torch.no_grad():
        return float(hf_model(input_ids=torch.tensor(IDS), attention_mask=torch.tensor(MASK),
                              position_ids=torch.tensor(positions), output_router_logits=True).aux_loss)


def _our_aux_loss(model, params):
    def balance(params):
        _, state = model.apply({"params": params}, jnp.asarray(IDS), jnp.asarray(MASK), mutable=["intermediates"])
        return layers.router_losses(state["intermediates"])[0]
    return float(jax.jit(balance)(params))


@pytest.mark.parametrize("name,scan", [("mixtral", True), ("qwen3_moe", False),
                                       pytest.param("mixtral", False, marks=pytest.mark.slow),
                                       pytest.param("qwen3_moe-sparse", True, marks=pytest.mark.slow)])
def test_logits_and_load_balancing_match_transformers_and_round_trip(hf_checkpoint, tmp_path, name, scan):
    """A left-padded batch of 16-token rows: logits within 1e-4 of transformers', load -> save -> load an identity,
    transformers reads the export back (tests/test_mistral.py's `check_round_trip`); the load-balancing loss over the
    real tokens equals transformers' aux_loss."""
    hf_model, path = hf_checkpoint(name)
    model, params = check_round_trip(hf_model, path, tmp_path, scan)
    assert models.registry.model_type(model) == name.split("-")[0]
    assert _our_aux_loss(model, params) == pytest.approx(_hf_aux_loss(hf_model), rel=1e-5)
    saved = {k for k in json.loads((tmp_path / "config.json").read_text())}
    assert {"num_experts_per_tok", "router_aux_loss_coef"} <= saved
    if name == "qwen3_moe":  # layer 1 dense: a gated MLP of intermediate_size, no router
        assert set(params["layers_1"]["mlp"]) == {"gate", "up", "down"}
        assert params["layers_0"]["mlp"]["experts"]["down"].shape == (4, 32, 64)


@pytest.mark.parametrize("name", ["mixtral", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_greedy_generate_matches_transformers(hf_checkpoint, name):
    hf_model, path = hf_checkpoint(name)
    check_greedy_generate(hf_model, *models.load_pretrained(path, scan_layers=name == "mixtral"), new=8)


def test_trainer_step_on_2x2x2_equals_one_device():
    """One SGD step (the update is the gradient: Adam's first step would amplify rounding in the near-zero ones) of
    the tiny Qwen3-MoE through the Trainer on a data 2 x fsdp 2 x model 2 mesh equals the step on one device: the
    same loss and router metrics, the same updated weights."""
    model = models.create_model("qwen3_moe", "tiny", scan_layers=True, router_z_loss_coef=1e-3)
    params = models.init_params(model, jax.random.PRNGKey(0))
    # one global batch: 1 row x data 2 x fsdp 2
    _, grads = tt.assert_sgd_step_equals_one_device(model, params, tt.lm_rows(4), engine.make_mesh(data=2, fsdp=2,
                                                                                                     model=2))
    moved = jax.tree.map(lambda g: np.abs(g).max(), grads)
    assert moved["layers"]["mlp"]["experts"]["gate"] > 1e-4 and moved["layers"]["mlp"]["router"]["kernel"] > 1e-4


@pytest.mark.slow
def test_shard_map_step_with_the_overlapped_layer_stack_equals_the_jit_step():
    """The shard_map step (ZeRO-3 over fsdp, remat='full': the hand-pipelined layer scan re-evaluates the sown router
    statistics too) against the jit step on 2x2x2: equal updates and router losses, the load-balancing one weighing
    0.5 (its statistics summed over the manual axes before the loss)."""
    model = models.create_model("mixtral", "tiny", scan_layers=True, remat="full", router_aux_loss_coef=0.5,
                                router_z_loss_coef=1e-2)
    params = models.init_params(model, jax.random.PRNGKey(0))
    rng = np.random.RandomState(0)
    rows = [{"tokens": rng.randint(3, 120, 17).astype(np.int32), "segment_ids": np.ones(17, np.int32)}
            for _ in range(4)]
    runs = {}
    for step in ("jit", "shard_map"):
        trainer = engine.Trainer(mesh=engine.make_mesh(data=2, fsdp=2, model=2), collate_fn=lm.collate_lm,
                                 loss_fn=lm.lm_loss_fn(model), params=params, optimizer=optax.sgd(1.0),
                                 parallelism=engine.Parallelism(step=step))
        trainer.fit(rows, per_device_batch_size=1, max_steps=1, log_every=1)
        runs[step] = trainer.history[-1], jax.device_get(trainer.params)
    (jit, jit_params), (manual, manual_params) = runs["jit"], runs["shard_map"]
    assert manual["loss"] == pytest.approx(jit["loss"], rel=1e-5)
    for key in ("load_balancing_loss", "router_z_loss"):
        assert manual[key] == pytest.approx(jit[key], rel=1e-5), key
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(manual_params)[0], jax.tree.leaves(jit_params)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5, err_msg=jax.tree_util.keystr(path))


# The released config.json files (mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B), as transformers 4.x wrote them
_RELEASED = {
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], attention_dropout=0.0, bos_token_id=1, eos_token_id=2, hidden_act="silu",
        hidden_size=4096, initializer_range=0.02, intermediate_size=14336, max_position_embeddings=32768,
        model_type="mixtral", num_attention_heads=32, num_experts_per_tok=2, num_hidden_layers=32,
        num_key_value_heads=8, num_local_experts=8, output_router_logits=False, rms_norm_eps=1e-05,
        rope_theta=1000000.0, router_aux_loss_coef=0.02, sliding_window=None, tie_word_embeddings=False,
        torch_dtype="bfloat16", use_cache=True, vocab_size=32000),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], attention_bias=False, attention_dropout=0.0, bos_token_id=151643,
        decoder_sparse_step=1, eos_token_id=151645, head_dim=128, hidden_act="silu", hidden_size=2048,
        initializer_range=0.02, intermediate_size=6144, max_position_embeddings=40960, max_window_layers=48,
        mlp_only_layers=[], model_type="qwen3_moe", moe_intermediate_size=768, norm_topk_prob=True,
        num_attention_heads=32, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_key_value_heads=4,
        output_router_logits=False, rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000.0,
        router_aux_loss_coef=0.001, sliding_window=None, tie_word_embeddings=False, torch_dtype="bfloat16",
        use_cache=True, use_sliding_window=False, vocab_size=151936),
}


@pytest.mark.parametrize("family,name", [("mixtral", "mixtral-8x7b"), ("qwen3_moe", "qwen3-30b-a3b")])
def test_released_config_json_reads_as_the_named_config(family, name):
    """The released config.json (Qwen3-MoE's `num_experts`, transformers 5's `num_local_experts` both read) gives the
    named config, and our export of it names the same experts."""
    config = models.config_from_hf(_RELEASED[name])
    assert config == models.get_config(family, name)
    exported = models.registry.family(family).config_to_hf(config)
    assert {k: exported[k] for k in ("num_experts_per_tok", "router_aux_loss_coef")} == {
        k: _RELEASED[name][k] for k in ("num_experts_per_tok", "router_aux_loss_coef")}


@pytest.mark.parametrize("family,name,count", [("mixtral", "mixtral-8x7b", 46_702_792_704),
                                               ("qwen3_moe", "qwen3-30b-a3b", 30_532_122_624)])
def test_named_configs_have_the_released_parameter_counts(family, name, count):
    """The counts transformers reports for mistralai/Mixtral-8x7B-v0.1 (46.7B) and Qwen/Qwen3-30B-A3B (30.5B)."""
    shapes = jax.eval_shape(lambda: models.init_params(models.create_model(family, name, scan_layers=True)))
    assert sum(np.prod(s.shape) for s in jax.tree_util.tree_leaves(shapes)) == count


def test_bad_moe_configs_are_refused_in_one_line(hf_checkpoint, tmp_path):
    config = json.loads(open(f"{hf_checkpoint('qwen3_moe')[1]}/config.json").read())
    for change, match in ((dict(num_experts_per_tok=5), r"num_experts_per_tok=5; expected an integer in 1 \.\.\. 4 "
                                                        r"\(num_experts\)"),
                          (dict(mlp_only_layers=[2]), r"mlp_only_layers=\(2,\); expected a tuple of layer indices in "
                                                      r"0 \.\.\. 1")):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path))}/config\.json: {match}$"):
            models.load_model(str(tmp_path))
    with pytest.raises(ValueError, match=r"^scan_layers=True with dense layers among the sparse ones .*; expected "
                                         r"scan_layers=False: a scan needs one kind of layer$"):
        models.create_model("qwen3_moe", "tiny", scan_layers=True, mlp_only_layers=(1,))
    with pytest.raises(ValueError, match=r"^expert_exchange='ragged_all_to_all'; expected one of \(None, 'ragged', "
                                         r"'padded'\) \(None: ragged on GPU / TPU, padded on CPU\)$"):
        models.create_model("mixtral", "tiny", expert_exchange="ragged_all_to_all")
    assert models.create_model("mixtral", "tiny", expert_exchange="padded").config.expert_exchange == "padded"
    assert dataclasses.replace(models.get_config("mixtral"), num_experts=8).num_experts == 8
