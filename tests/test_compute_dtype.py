"""The compute dtype governs the model: `Precision(compute_dtype=bf16)` makes every matmul of every family bf16.

Read off the program the Trainer hands the compiler (its lowered step, for this host and for cuda): XLA:CPU's own
compile widens bf16 dots to fp32 (a CPU code-generation choice), so the compiled CPU program cannot show it. A dot
whose operands are fp32 is allowed only where it is a per-row sum (no free dimension on either side, e.g. the
attention backward's sum(dO * O) in fp32): no matmul FLOP runs in fp32."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import engine
import models
from engine.tasks import lm, seq2seq

_DOT = re.compile(r"stablehlo\.dot_general [^\n]*?(?:batching_dims = \[([\d, ]*)\] x \[[\d, ]*\], )?"
                  r"contracting_dims = \[([\d, ]*)\] x \[([\d, ]*)\][^\n]*?: \(tensor<([^>]*)>, tensor<([^>]*)>\)"
                  r" -> tensor<([^>]*)>")


def _dots(text):
    """[(lhs dtype, rhs dtype, free dims of lhs, free dims of rhs)] of every dot_general in a lowered program."""
    found = []
    for batch, lhs_c, rhs_c, lhs, rhs, _ in _DOT.findall(text):
        n_batch = len([d for d in batch.split(",") if d.strip()])
        rank = lambda t: len(t.split("x")) - 1  # noqa: E731 - 'AxBxbf16': the dims, then the dtype
        free_l = rank(lhs) - n_batch - len(lhs_c.split(","))
        free_r = rank(rhs) - n_batch - len(rhs_c.split(","))
        found.append((lhs.split("x")[-1], rhs.split("x")[-1], free_l, free_r))
    assert len(found) == text.count("stablehlo.dot_general"), "a dot_general the pattern did not read"
    return found


def _rows(n, seq, vocab=120):
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(1, vocab, seq + 1).astype(np.int32), "segment_ids": np.ones(seq + 1, np.int32)}
            for _ in range(n)]


def _pairs(n):
    rng = np.random.default_rng(0)
    return [{"input_ids": rng.integers(1, 100, 12).astype(np.int32), "attention_mask": np.ones(12, np.int32),
             "decoder_input_ids": rng.integers(1, 100, 8).astype(np.int32),
             "labels": rng.integers(1, 100, 8).astype(np.int32)} for _ in range(n)]


def _lowered(model, *, loss_implementation=None, platforms=None, compute_dtype=jnp.bfloat16, step="jit"):
    params = models.init_params(model, jax.random.PRNGKey(0))
    if getattr(model, "is_encoder_decoder", False):
        loss, collate, examples = seq2seq.seq2seq_loss_fn(model, loss_implementation), seq2seq.collate_seq2seq, \
            _pairs(8)
    else:
        loss, collate, examples = lm.lm_loss_fn(model, loss_implementation), lm.collate_lm, _rows(8, 16)
    trainer = engine.Trainer(mesh=engine.make_mesh(data=1, fsdp=1, devices=jax.devices()[:1]) if step == "jit"
                             else engine.make_mesh(data=2, fsdp=4), collate_fn=collate, loss_fn=loss, params=params,
                             optimizer=optax.adamw(1e-3), precision=engine.Precision(compute_dtype=compute_dtype),
                             parallelism=engine.Parallelism(step=step))
    rows = 1 if step == "jit" else 8
    batch = jax.tree.map(lambda x: x[None], collate(examples[:rows]))
    return trainer.lower(batch, platforms=platforms).as_text()


def _check_bf16(text):
    dots = _dots(text)
    matmuls = [d for d in dots if d[2] or d[3]]
    assert matmuls, "no matmul in the step"
    assert all(d[:2] == ("bf16", "bf16") for d in matmuls), sorted({d[:2] for d in matmuls})
    assert all(d[:2] == ("bf16", "bf16") or (d[2], d[3]) == (0, 0) for d in dots), dots


FAMILIES = {
    "llama": dict(scan_layers=True, remat="full"),
    "mixtral": dict(),
    "gemma2": dict(),
    "gptj": dict(),
    "opt": dict(),
    "t5": dict(),
}
_SLOW = pytest.mark.slow  # CI time: the layers these families share with the default ones are read there


@pytest.mark.parametrize("family", [f if f in ("llama", "mixtral", "t5") else pytest.param(f, marks=_SLOW)
                                    for f in FAMILIES])
def test_bf16_compute_makes_every_matmul_bf16(family):
    """Precision(compute_dtype=bf16) with fp32 master weights and the config's dtype unset: every matmul of the
    lowered step (forward and backward, attention, MLP or experts, head) takes bf16 operands."""
    model = models.create_model(family, "tiny", **FAMILIES[family])
    assert model.config.dtype is None
    _check_bf16(_lowered(model))


@pytest.mark.parametrize("case", ["cuda", pytest.param("fused_loss", marks=_SLOW), "shard_map"])
def test_bf16_compute_on_gpu_lowering_fused_loss_and_shard_map_step(case):
    """The same for the program lowered for cuda (the Triton kernels are custom calls there), with the fused head
    + loss ('xla' blocks), and in the shard_map step (which casts on the shards, before its ZeRO gathers)."""
    model = models.create_model("llama", "tiny", scan_layers=True, remat="full")
    kwargs = {"cuda": dict(platforms=("cuda",)), "fused_loss": dict(loss_implementation="xla"),
              "shard_map": dict(step="shard_map")}[case]
    _check_bf16(_lowered(model, **kwargs))


def test_a_named_config_dtype_wins_and_fp32_stays_fp32():
    """A config that names its dtype computes in it whatever the parameters hold; with no compute dtype the fp32
    master weights compute in fp32 (the CPU default)."""
    named = models.create_model("llama", "tiny", dtype="float32")
    assert {d[:2] for d in _dots(_lowered(named)) if d[2] or d[3]} == {("f32", "f32")}
    plain = models.create_model("llama", "tiny")
    assert {d[:2] for d in _dots(_lowered(plain, compute_dtype=None)) if d[2] or d[3]} == {("f32", "f32")}


def test_forward_follows_the_parameters_dtype():
    """model.apply on bf16 parameters computes in bf16 (its logits leave the head in fp32) and matches the fp32
    model within bf16 rounding; generation (its KV cache in the parameters' dtype) runs on them."""
    model = models.create_model("llama", "tiny")
    params = models.init_params(model, jax.random.PRNGKey(0))
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 120, (2, 12)), jnp.int32)
    text = jax.jit(lambda p: model.apply({"params": p}, ids)).lower(half).as_text()
    assert {d[:2] for d in _dots(text) if d[2] or d[3]} == {("bf16", "bf16")}
    full, low = model.apply({"params": params}, ids), model.apply({"params": half}, ids)
    assert low.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(full - low))) < 0.05 * float(jnp.max(jnp.abs(full)))
    assert models.layers.compute_dtype(model.config, half) == jnp.bfloat16
    assert models.layers.compute_dtype(model.config) == jnp.float32  # no parameters: those it creates
    out = models.generate(model, half, ids[:, :4], max_new_tokens=3)
    assert out.shape == (2, 7)


def test_bad_config_dtype_is_one_line():
    with pytest.raises(ValueError, match=r"^dtype='int8'; expected a floating dtype name such as 'bfloat16' or None"):
        models.create_model("llama", "tiny", dtype="int8")
    with pytest.raises(ValueError, match=r"^param_dtype=None; expected a floating dtype name"):
        models.create_model("llama", "tiny", param_dtype=None)


def test_bf16_compute_holds_no_more_than_float32_in_the_zero3_shard_map_step():
    """The shard_map step on fsdp 8 casts each ZeRO-3 shard at its gather, a layer at a time: its compiled
    temporaries with bf16 compute stay at or below float32 compute's (measured 13.9 against 14.8 MB). Cast up front, a
    bf16 copy of every shard stayed alive through the step (17.1 MB here; LLaMA-7B on v5p-8 3.2 GB a chip)."""
    model = models.create_model("llama", "tiny", scan_layers=True, num_layers=4, vocab_size=4096, hidden_size=256,
                                intermediate_size=1024, num_heads=4, num_kv_heads=4, remat="full")
    params = models.init_params(model, jax.random.PRNGKey(0))

    def temporaries(dtype):
        trainer = engine.Trainer(mesh=engine.make_mesh(fsdp=8), collate_fn=lm.collate_lm,
                                 loss_fn=lm.lm_loss_fn(model), params=params, optimizer=optax.adam(1e-3),
                                 parallelism=engine.Parallelism(step="shard_map"),
                                 precision=engine.Precision(compute_dtype=dtype))
        trainer.fit(_rows(8, 16, vocab=4096), per_device_batch_size=1, max_steps=1, log_every=1)
        return trainer.compiled_step().memory_analysis().temp_size_in_bytes

    assert temporaries(jnp.bfloat16) <= temporaries(jnp.float32)
