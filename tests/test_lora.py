"""models/lora.py and LoRA in the layers: fresh adapters change nothing, merging equals the unmerged model, the
adapters follow their kernels' split, adapter-only training on a mesh freezes the rest, and export merges."""
import json
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import engine
import models
from engine.tasks import lm

IDS = np.random.RandomState(0).randint(3, 120, (2, 9))


def _logits(model, params):
    args = (IDS, IDS) if getattr(model, "is_encoder_decoder", False) else (IDS,)
    return np.asarray(model.apply({"params": params}, *args), np.float32)


def _perturbed(params, seed=1):
    """Every lora_b random (fresh ones are zero, which would hide a wrong product)."""
    key = jax.random.PRNGKey(seed)

    def perturb(path, x):
        name = engine.sharding.path_str(path)  # crc32, not hash(): str hashes change from process to process
        if not name.endswith("lora_b"):
            return x
        return 0.1 * jax.random.normal(jax.random.fold_in(key, zlib.crc32(name.encode()) % 2**31), x.shape, x.dtype)

    return jax.tree_util.tree_map_with_path(perturb, params)


@pytest.mark.parametrize("family,options", [
    pytest.param("llama", dict(scan_layers=True), marks=pytest.mark.slow),
    ("llama", dict(mlp_implementation="xla", lora_targets=("q", "gate"))),
    pytest.param("gptj", {}, marks=pytest.mark.slow),
    pytest.param("opt", dict(scan_layers=True), marks=pytest.mark.slow),
    pytest.param("t5", dict(lora_targets=("q", "v", "up")), marks=pytest.mark.slow)])
def test_fresh_adapters_change_nothing_and_merging_equals_the_adapted_model(family, options):
    base = models.create_model(family, "tiny", **{k: v for k, v in options.items() if k != "lora_targets"})
    base_params = models.init_params(base, jax.random.PRNGKey(0))
    model = base.clone(config=base.config.__class__(**{**base.config.__dict__, "lora_rank": 4, **options}))
    params = models.add_lora(model, base_params, jax.random.PRNGKey(2))
    adapters = [engine.sharding.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
                if re.search(models.LORA_TRAINABLE, engine.sharding.path_str(p))]
    kernels = [engine.sharding.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
               if engine.sharding.path_str(p).endswith("/kernel")]
    targeted = {k[:-len("kernel")] for k in kernels if k.split("/")[-2] in model.config.lora_targets}
    assert targeted and {a[:-len("lora_a")] for a in adapters if a.endswith("lora_a")} == targeted
    np.testing.assert_allclose(_logits(model, params), _logits(base, base_params), atol=1e-6)

    params = _perturbed(params)
    adapted = _logits(model, params)
    assert np.abs(adapted - _logits(base, base_params)).max() > 1e-3
    merged_model, merged = models.merge_lora(model, params)
    assert merged_model.config.lora_rank == 0 and not models.has_lora(merged)
    assert jax.tree.structure(merged) == jax.tree.structure(base_params)
    # fp32 rounding of W + A B against x W + (x A) B, relative to the logits' range
    np.testing.assert_allclose(_logits(merged_model, merged), adapted, atol=1e-5 * np.abs(adapted).max())


def test_adapters_follow_their_kernels_split():
    """Column-split kernels split B's columns, row-split ones A's rows; the base weights' layout is the one without
    LoRA (the adapters' own branch does not steer the trace)."""
    mesh = engine.make_mesh(data=1, fsdp=4, model=2)
    specs = {}
    for rank in (0, 4):
        model = models.create_model("llama", "tiny", scan_layers=True, lora_rank=rank)
        abstract = jax.eval_shape(lambda m=model: models.init_params(m))
        tree = engine.auto_shard(abstract, mesh, trace_fn=lambda p, m=model: m.apply({"params": p}, IDS))
        specs[rank] = {engine.sharding.path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: isinstance(x, P))[0]}
    assert {k: v for k, v in specs[4].items() if "lora" not in k} == specs[0]
    lora = specs[4]
    assert lora["layers/attn/q/lora_a"] == P() and "model" in lora["layers/attn/q/lora_b"]
    assert lora["layers/attn/o/lora_b"] == P() and lora["layers/attn/o/lora_a"][1] == "model"
    assert lora["layers/mlp/down/lora_a"][1] == "model" and lora["layers/mlp/up/lora_b"][2] == "model"


# All slow (CI time): the default run trains frozen sets on meshes in tests/test_trainer.py and checks the quantised
# bases' logits, layouts and kernels here.
@pytest.mark.parametrize("quantize", [pytest.param(q, marks=pytest.mark.slow) for q in (None, "int8", "nf4")])
def test_adapter_training_on_a_mesh_freezes_the_rest_and_exports_merged(tmp_path, quantize):
    """Adapter-only training (scanned, rematerialised LLaMA on 2x2x2, the shard_map step with ZeRO-3 gathers and its
    pipelined layer stack), on a float, int8 or nf4 base: the loss falls, every base weight keeps its exact value, the
    optimizer state is the adapters' size, and the transformers export (adapters merged, weights dequantised) gives
    the trained model's logits."""
    base = models.create_model("llama", "tiny", scan_layers=True, remat="full")
    mesh = engine.make_mesh(data=2, fsdp=2, model=2)
    base_params = models.init_params(base, jax.random.PRNGKey(0), layout=engine.auto_layout(mesh))
    if quantize:
        base, base_params = models.quantize(base, base_params, quantize)
    model = base.clone(config=base.config.__class__(**{**base.config.__dict__, "lora_rank": 8, "lora_alpha": 16.0}))
    params = models.add_lora(model, base_params, layout=engine.auto_layout(mesh))
    before = jax.device_get(params)
    rng = np.random.RandomState(0)
    # Eight frequent tokens: learnable through the adapters (a random base's frozen head and final norm bound the
    # logits' range, so the loss stops near 4.4 however long it trains; full fine-tuning reaches log 8 = 2.1).
    rows = [{"tokens": rng.randint(3, 11, 17).astype(np.int32), "segment_ids": np.ones(17, np.int32)}
            for _ in range(64)]
    loss_fn = lm.lm_loss_fn(model)
    loss_fn.weight_metric = "tokens"
    trainer = engine.Trainer(mesh=mesh, collate_fn=lm.collate_lm, loss_fn=loss_fn, params=params,
                             optimizer=optax.adam(3e-2), trainable=models.LORA_TRAINABLE,
                             parallelism=engine.Parallelism(step="shard_map"))
    trainer.fit(rows, per_device_batch_size=2, max_steps=8, log_every=8)
    assert trainer.history[-1]["loss"] < trainer.history[0]["loss"] - 0.2
    after = jax.device_get(trainer.params)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(after)):
        name = engine.sharding.path_str(path)
        assert ("lora" in name) != np.array_equal(a, b), name
    adapter_size = sum(x.size for p, x in jax.tree_util.tree_flatten_with_path(before)[0]
                       if "lora" in engine.sharding.path_str(p))
    assert sum(x.size for x in jax.tree.leaves(trainer.opt_state)) == 2 * adapter_size + 1  # Adam: mu, nu, count

    if quantize:
        assert after["layers"]["mlp"]["up"]["kernel"].dtype == (np.int8 if quantize == "int8" else np.uint8)
    models.save_pretrained(model, trainer.params, str(tmp_path))
    loaded, loaded_params = models.load_pretrained(str(tmp_path))
    assert not models.has_lora(loaded_params)
    np.testing.assert_allclose(_logits(loaded, loaded_params), _logits(model, after), atol=2e-5)
    if quantize:
        return
    # Loading with lora_rank adds fresh adapters to the merged model: the same logits again.
    again, again_params = models.load_pretrained(str(tmp_path), lora_rank=4, scan_layers=True)
    assert again.config.lora_rank == 4 and models.has_lora(again_params)
    np.testing.assert_allclose(_logits(again, again_params), _logits(model, after), atol=2e-5)


def test_lora_bad_input_errors():
    for bad, match in [(dict(lora_rank=-1), "lora_rank"), (dict(lora_rank=4, lora_targets=("qkv",)), "lora_targets"),
                       (dict(lora_rank=4, lora_alpha=0.0), "lora_alpha"),
                       (dict(quantize="int4"), r"quantize='int4'; expected one of \(None, 'int8', 'nf4'\)")]:
        with pytest.raises(ValueError, match=match):
            models.get_config("llama", "tiny", **bad)
    with pytest.raises(ValueError, match="quantize='nf4' on a projection of 96 inputs"):
        jax.eval_shape(lambda: models.init_params(models.create_model("llama", "tiny", hidden_size=96,
                                                                      quantize="nf4")))
    base = models.create_model("llama", "tiny")
    params = models.init_params(base)
    with pytest.raises(ValueError, match="fmt='int4'; expected one of"):
        models.quantize(base, params, "int4")
    with pytest.raises(ValueError, match="lora_rank=0"):
        models.add_lora(base, params)
    model = models.create_model("llama", "tiny", lora_rank=2)
    with pytest.raises(ValueError, match="already hold"):
        models.add_lora(model, models.init_params(model))
    with pytest.raises(ValueError, match="missing"):
        models.add_lora(model, {k: v for k, v in params.items() if k != "lm_head"})
    assert jnp.shape(models.add_lora(model, params)["layers_0"]["attn"]["q"]["lora_a"]) == (64, 2)


@pytest.mark.parametrize("family,targets", [
    ("llama", ("q", "v", "down")), pytest.param("opt", ("k", "o", "up", "down"), marks=pytest.mark.slow)])
def test_peft_adapter_round_trip_and_transformers_reads_it(tmp_path, family, targets):
    """`save_lora_adapter` writes PEFT's layout (adapter_config.json, base_model.model.<module>.lora_A/B.weight):
    `load_lora_adapter` on the base gives the same model back, and the transformers base model with B A alpha / r
    added to each named module's weight (what PEFT computes) gives our adapted logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = models.create_model(family, "tiny", scan_layers=family == "llama", lora_rank=4, lora_alpha=8.0,
                                lora_targets=targets)
    params = _perturbed(models.init_params(model, jax.random.PRNGKey(0)))
    base_model = models.lora.without_lora(model)
    strip = lambda t: {k: strip(v) for k, v in t.items() if "lora" not in k} if isinstance(t, dict) else t  # noqa
    base_params = strip(params)  # the base the adapters apply to
    models.save_pretrained(base_model, base_params, str(tmp_path / "base"))
    models.save_lora_adapter(model, params, str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"

    again, again_params = models.load_lora_adapter(base_model, base_params, str(tmp_path / "adapter"))
    assert again.config.lora_targets == targets
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    from safetensors.numpy import load_file
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")).eval()
    weights = dict(torch_model.named_parameters())
    adapters = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    names = {k[len("base_model.model."):-len(".lora_A.weight")] for k in adapters if k.endswith("lora_A.weight")}
    assert {n.rsplit(".", 1)[-1] for n in names} == set(config["target_modules"])
    with torch.no_grad():
        for name in names:
            a, b = (adapters[f"base_model.model.{name}.lora_{k}.weight"] for k in "AB")
            weights[f"{name}.weight"] += torch.from_numpy(b @ a * (8.0 / 4))
        theirs = torch_model(torch.from_numpy(IDS)).logits.numpy()
    np.testing.assert_allclose(theirs, _logits(model, params), rtol=1e-4, atol=1e-4)


def test_bad_peft_adapters_are_refused(tmp_path):
    model = models.create_model("llama", "tiny", lora_rank=2, lora_targets=("q",))
    params = models.init_params(model)
    models.save_lora_adapter(model, params, str(tmp_path))
    base_model, base_params = models.merge_lora(model, params)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    for change, match in [({"use_rslora": True}, "use_rslora"), ({"target_modules": ["c_attn"]}, "c_attn"),
                          ({"target_modules": "q_proj"}, "target_modules")]:
        (tmp_path / "adapter_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=match):
            models.load_lora_adapter(base_model, base_params, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        models.load_lora_adapter(base_model, base_params, str(tmp_path / "nothing"))


# Largest logit error of a quantised tiny LLaMA, relative to the logits' range: nf4's 16 levels (a weight's error
# about 9% of its spread, measured) against int8's 255.
QUANTIZED_LOGIT_ERROR = {"int8": 0.02, "nf4": 0.25}


@pytest.mark.parametrize("fmt", [pytest.param("int8", marks=pytest.mark.slow), "nf4"])
def test_quantised_base_is_close_to_float_and_loads_quantised_as_read(tmp_path, fmt):
    """`models.quantize` keeps the logits close to the float model's; its dequantised weights give the quantised
    model's logits; `load_pretrained(quantize=fmt)` quantises each tensor as it reads it, to the same values; the
    quantised kernels split over `model` as the float ones do (their scales follow); a Trainer refuses to train
    them."""
    model = models.create_model("llama", "tiny", scan_layers=True)
    params = models.init_params(model, jax.random.PRNGKey(0))
    q_model, q_params = models.quantize(model, params, fmt)
    q = q_params["layers"]["attn"]["q"]
    if fmt == "int8":
        assert q["kernel"].dtype == jnp.int8 and q["kernel_scale"].shape == (2, 64)
    else:  # [layers, in / 2, out] codes two a byte, an absmax per 64 rows
        assert q["kernel"].dtype == jnp.uint8 and q["kernel"].shape == (2, 32, 64) and q["kernel_scale"].shape == (
            2, 1, 64)
    assert "kernel_scale" not in q_params["lm_head"]
    ref, got = _logits(model, params), _logits(q_model, q_params)
    assert np.abs(got - ref).max() < QUANTIZED_LOGIT_ERROR[fmt] * np.abs(ref).max()
    np.testing.assert_allclose(_logits(*models.dequantize(q_model, q_params)), got, rtol=1e-5, atol=1e-5)

    models.save_pretrained(model, params, str(tmp_path))
    read_model, read = models.load_pretrained(str(tmp_path), scan_layers=True, quantize=fmt)
    assert read_model.config.quantize == fmt
    for a, b in zip(jax.tree.leaves(q_params), jax.tree.leaves(read)):
        assert a.shape == b.shape and a.dtype == b.dtype
        if jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        else:  # a code may flip where the float32 round trip through the checkpoint lands on a rounding boundary
            assert np.mean(np.asarray(a) == np.asarray(b)) > 0.999

    mesh = engine.make_mesh(data=1, fsdp=4, model=2)
    specs = [{engine.sharding.path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(engine.auto_shard(
        jax.eval_shape(lambda m=m: models.init_params(m)), mesh, trace_fn=lambda p, m=m: m.apply({"params": p}, IDS)),
        is_leaf=lambda x: isinstance(x, P))[0]} for m in (model, q_model)]
    assert {k: v for k, v in specs[1].items() if "kernel_scale" not in k} == specs[0]
    # Column splits: the scales follow (nf4's trace sees through the dequantisation to the matmul).
    assert specs[1]["layers/attn/q/kernel_scale"] == (P(None, "model") if fmt == "int8" else P(None, None, "model"))
    with pytest.raises(ValueError, match="integer parameter"):
        engine.Trainer(mesh=mesh, collate_fn=lm.collate_lm, loss_fn=lm.lm_loss_fn(q_model), params=q_params,
                       optimizer=optax.sgd(0.1))


@pytest.mark.parametrize("implementation, with_grads", [
    ("xla", False), pytest.param("xla", True, marks=pytest.mark.slow), pytest.param("triton", True,
                                                                                  marks=pytest.mark.slow)])
def test_int8_base_through_the_fused_kernels_equals_the_plain_path(implementation, with_grads):
    """With mlp_implementation the int8 MLP runs kernels.gated_mlp on its int8 kernels (scales in the epilogue), or
    kernels.fused_matmul per projection where adapters sit on gate (with_grads): logits, and there the gradients of
    gate's adapters and column scales, equal the plain (x q) s path."""
    for targets in ((), ("gate", "down")) if with_grads else ((),):
        options = dict(scan_layers=True, lora_rank=4 if targets else 0, lora_targets=targets or ("q",))
        model = models.create_model("llama", "tiny", quantize="int8", **options)
        params = _perturbed(models.init_params(model, jax.random.PRNGKey(0)))
        fused = models.create_model("llama", "tiny", quantize="int8", mlp_implementation=implementation,
                                    kernel_interpret=implementation != "xla", **options)
        gate = params["layers"]["mlp"]["gate"]
        floats = {k: v for k, v in gate.items() if k != "kernel"}

        def logits_fn(f, m):
            p = {**params, "layers": {**params["layers"], "mlp": {**params["layers"]["mlp"], "gate": {**gate, **f}}}}
            return m.apply({"params": p}, IDS).astype(jnp.float32)

        if not targets:
            np.testing.assert_allclose(*(jax.jit(logits_fn, static_argnums=1)(floats, m) for m in (fused, model)),
                                       rtol=2e-5, atol=2e-5)
            continue
        run = jax.jit(lambda f, m: (logits_fn(f, m), jax.grad(lambda f: jnp.mean(logits_fn(f, m) ** 2))(f)),
                      static_argnums=1)
        (got, got_grads), (want, want_grads) = run(floats, fused), run(floats, model)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)  # 1e-5 of the largest


@pytest.mark.slow
def test_lora_dropout_drops_the_adapters_input_in_training_calls_only():
    """lora_dropout (PEFT's): training calls differ by their dropout rng and only through the adapters (with B = 0
    nothing changes); evaluation calls equal the model without dropout."""
    model = models.create_model("llama", "tiny", scan_layers=True, lora_rank=4, lora_dropout=0.3)
    params = models.init_params(model, jax.random.PRNGKey(0))
    train = lambda p, seed: np.asarray(model.apply({"params": p}, IDS, train=True,  # noqa: E731
                                                   rngs={"dropout": jax.random.PRNGKey(seed)}))
    np.testing.assert_array_equal(train(params, 1), _logits(model, params))  # fresh adapters: B = 0
    params = _perturbed(params)
    a, b = train(params, 1), train(params, 2)
    assert np.abs(a - b).max() > 1e-4
    undropped = model.clone(config=model.config.__class__(**{**model.config.__dict__, "lora_dropout": 0.0}))
    np.testing.assert_allclose(_logits(model, params), _logits(undropped, params), rtol=1e-6, atol=1e-6)
