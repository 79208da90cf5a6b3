"""`kernels.attention.mosaic_gpu` (the warp-specialised Hopper flash attention in Mosaic GPU): its forward and
backward (segment ids, soft cap, dropout, head dims 64 / 128 / 256) run in Mosaic GPU's interpreter on the CPU
against `mha_reference` in float32, directly and through `kernels.flash_attention`, and compiled for sm_90a without
a GPU (`kernels/mosaic_gpu_compile.py`). Both need JAX >= 0.11 (`make test-gpu-compile`); under the project's JAX they
skip in one line. Marked `gpu_compile`: each interpreted case takes seconds, each compile seconds."""
import jax
import jax.numpy as jnp
import pytest

from kernels.attention import mosaic_gpu
from kernels.attention.reference import dropout_keys, mha_reference

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(not mosaic_gpu.AVAILABLE, reason=f"JAX {jax.__version__} has no Mosaic GPU kernel API "
                                                        "(plgpu.kernel, JAX >= 0.11): make test-gpu-compile"),
]


def _packed(key, B, T, docs):
    """int32 [B, T] segment ids of `docs` documents a row, packed (ids 0 ... docs - 1 in order), their boundaries at
    random positions (so not on tile edges)."""
    cuts = jnp.sort(jax.vmap(lambda k: jax.random.choice(k, jnp.arange(1, T), (docs - 1,), replace=False))(
        jax.random.split(key, B)), axis=1)
    return jnp.sum(jnp.arange(T)[None, :, None] >= cuts[:, None, :], axis=2).astype(jnp.int32)


def _segments(key, B, T, S, docs, kv_len=None):
    """(q_ids [B, T], kv_ids [B, S]) or (None, None) without `docs`: self-attention shares one packing; with T != S
    the queries' ids are shifted by one, so that the last document's queries find no key (fully masked rows), and
    the padded keys past kv_len carry the last real id (only the length mask hides them)."""
    if docs is None:
        return None, None
    n = kv_len or S
    kv_ids = jnp.pad(_packed(key, B, n, docs), ((0, 0), (0, S - n)), mode="edge")
    return (kv_ids, kv_ids) if T == S else (_packed(jax.random.fold_in(key, 1), B, T, docs) + 1, kv_ids)


def _attend(B, T, S, H, KVH, D, *, causal=False, dtype=jnp.bfloat16, kv_len=None, window=None, block_k=None,
            stages=None, docs=None, cap=None, dropout=0.0):
    """(out, lse [B, H, T] natural, reference out, reference lse) at one shape; kv_len: the real keys of S; docs:
    packed documents a row (segment ids); cap: the logit soft cap; dropout: its rate."""
    from kernels import mosaic_gpu_compile

    plan = mosaic_gpu_compile.attention_plan(D, causal=causal, interpret=True, kv_len=kv_len, window=window,
                                             block_k=block_k, stages=stages, logit_soft_cap=cap, dropout_rate=dropout)
    keys = jax.random.split(jax.random.key(T * 131 + S * 7 + D + H), 5)
    q = jax.random.normal(keys[0], (B, T, H, D), jnp.float32).astype(dtype)
    k, v = (jax.random.normal(key, (B, S, KVH, D), jnp.float32).astype(dtype) for key in keys[1:3])
    q_ids, kv_ids = _segments(keys[3], B, T, S, docs, kv_len)
    drop = dropout_keys(keys[4], B, H) if dropout else None
    out, lse = jax.jit(lambda q, k, v, q_ids, kv_ids, drop: mosaic_gpu.forward(q, k, v, q_ids, kv_ids, drop, plan))(
        q, k, v, q_ids, kv_ids, drop)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    n = kv_len or S
    q, k, v = f32(q), f32(k)[:, :n], f32(v)[:, :n]
    kv_ids = None if docs is None else kv_ids[:, :n]
    ref = mha_reference(q, k, v, causal=causal, window=window, logit_soft_cap=cap,
                        segment_ids=None if docs is None else (q_ids, kv_ids), dropout_rate=dropout,
                        dropout_keys=drop)
    G = H // KVH
    s = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, G, axis=2)) * D**-0.5
    s = s if cap is None else cap * jnp.tanh(s / cap)
    mask = _mask(T, n, causal, window)
    if docs is not None:
        mask = mask & (q_ids[:, None, :, None] == kv_ids[:, None, None, :])
    ref_lse = jax.nn.logsumexp(jnp.where(mask, s, -jnp.inf), axis=-1)
    return f32(out), mosaic_gpu.lse_rows(lse, q.shape).swapaxes(1, 2), ref, ref_lse


def _mask(T, S, causal, window):
    i, j = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
    mask = jnp.ones((T, S), bool)
    if causal:
        mask &= j <= i
    if window is not None:
        mask &= (j >= i - window[0]) & (j <= i + window[1])
    return mask


def _rel(x, ref):
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


# (B, T, S, H, KVH, D, options): causal or not, grouped heads, the three head dims, both tile widths, three
# stages, padded keys (kv_len), a sliding window, T != S.
CASES = {
    "full D64 GQA 4/2": (2, 128, 256, 4, 2, 64, dict(block_k=64, stages=3)),
    "causal D64 bk64": (1, 256, 256, 1, 1, 64, dict(causal=True, block_k=64)),
    "causal D64 bk128 f16": (1, 256, 256, 2, 1, 64, dict(causal=True, dtype=jnp.float16)),
    "causal D128 GQA 2/1": (1, 256, 256, 2, 1, 128, dict(causal=True)),
    "full D256": (1, 128, 128, 1, 1, 256, {}),
    "causal D256": (1, 256, 256, 1, 1, 256, dict(causal=True)),
    "full padded keys": (1, 128, 384, 1, 1, 64, dict(kv_len=300)),
    "causal window": (1, 384, 384, 1, 1, 64, dict(causal=True, window=(100, 0), block_k=64)),
    # Segment ids: packed documents (several a row, boundaries inside tiles) under the causal band; cross-attention
    # with padded keys whose last query document sees no key; the soft cap alone and with segments.
    "causal packed D64 GQA 2/1": (2, 256, 256, 2, 1, 64, dict(causal=True, docs=4, block_k=64)),
    "full packed padded keys D128": (1, 128, 384, 1, 1, 128, dict(kv_len=300, docs=3)),
    "causal soft cap D64": (1, 256, 256, 1, 1, 64, dict(causal=True, cap=2.0)),
    "causal packed soft cap D128": (1, 256, 256, 2, 1, 128, dict(causal=True, docs=3, cap=2.0)),
    # Tile skipping by segment bounds: 12 documents in 384 tokens (each consumer's rows meet a few key tiles); 256
    # queries of documents 1 and 2 against 128 keys of 0 and 1 (the last CTA's 128 queries all of 2: no tile to
    # visit).
    "full packed D64 many documents": (1, 384, 384, 1, 1, 64, dict(docs=12, block_k=64)),
    "cross packed D64 GQA 2/1 empty CTA": (1, 384, 128, 2, 1, 64, dict(docs=2, block_k=64)),
    # Dropout: the reference's mask bit for bit (a differing bit would move the output by far more than rounding).
    "causal dropout D64 GQA 2/1": (2, 256, 256, 2, 1, 64, dict(causal=True, dropout=0.1, block_k=64)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_interpreted_matches_reference(case):
    *shape, options = CASES[case]
    out, lse, ref, ref_lse = _attend(*shape, **options)
    # bf16 / f16 outputs and probabilities: the rounding of one 16-bit value per entry (measured 2e-3 in bf16).
    assert _rel(out, ref) < 5e-3, case
    seen = ref_lse > -jnp.inf  # a query with no visible key: the kernel's lse is +inf and its output 0
    assert float(jnp.max(jnp.where(seen, jnp.abs(lse - ref_lse), 0.0))) < 1e-2, case
    assert bool(jnp.all(jnp.where(seen, True, lse == jnp.inf))), case
    if "docs" in options and shape[1] != shape[2]:
        assert not bool(jnp.all(seen)), case  # the case holds fully masked rows
        assert float(jnp.max(jnp.abs(jnp.where(seen.swapaxes(1, 2)[..., None], 0.0, out)))) == 0.0, case


# (B, T, S, H, KVH, D, options) of the backward: the dk / dv kernel's loop over a group's heads, the causal band
# (both kernels pass by tiles of the CTA's band), padded keys (dq masks them; dk / dv rows past them are cut off),
# a window, head dim 128 with 128-query dk / dv tiles.
BACKWARD_CASES = {
    "causal D64 GQA 2/1": (1, 256, 256, 2, 1, 64, dict(causal=True)),
    "full D64 padded keys": (1, 128, 384, 1, 1, 64, dict(kv_len=300)),
    "causal window": (1, 384, 384, 1, 1, 64, dict(causal=True, window=(100, 0))),
    "full D128 GQA 2/1": (1, 128, 256, 2, 1, 128, dict(block_q_bwd=128)),
    # Segment ids (both kernels' id rings: kv ids beside dq's K / V, q ids beside dk / dv's q, do, lse, delta) and
    # the soft cap's derivative.
    "causal packed D64 GQA 2/1": (2, 256, 256, 2, 1, 64, dict(causal=True, docs=4)),
    "full packed padded keys D64": (1, 128, 384, 1, 1, 64, dict(kv_len=300, docs=3)),
    "causal packed soft cap D128": (1, 256, 256, 1, 1, 128, dict(causal=True, docs=3, cap=2.0)),
    # Tile skipping in both kernels, with GQA.
    "full packed D64 GQA 2/1 many documents": (1, 384, 384, 2, 1, 64, dict(docs=12)),
    # Dropout (dq's dp, dk / dv's p and dp).
    "causal packed dropout D64 GQA 2/1": (1, 256, 256, 2, 1, 64, dict(causal=True, docs=3, dropout=0.1)),
    # Head dim 256: dv and dk apart, one-stage rings; GQA, segments and dropout through the split kernels.
    "causal D256 GQA 2/1 packed dropout": (1, 256, 256, 2, 1, 256, dict(causal=True, docs=3, dropout=0.1)),
}


@pytest.mark.parametrize("case", list(BACKWARD_CASES))
def test_backward_interpreted_matches_reference(case):
    from kernels import mosaic_gpu_compile

    B, T, S, H, KVH, D, options = BACKWARD_CASES[case]
    causal, window, kv_len = options.get("causal", False), options.get("window"), options.get("kv_len")
    cap, dropout = options.get("cap"), options.get("dropout", 0.0)
    plan = mosaic_gpu_compile.attention_plan(D, causal=causal, interpret=True, kv_len=kv_len, window=window,
                                             block_q_bwd=options.get("block_q_bwd", 64), logit_soft_cap=cap,
                                             dropout_rate=dropout)
    keys = jax.random.split(jax.random.key(T + S + D), 6)
    q, do = (jax.random.normal(key, (B, T, H, D), jnp.float32).astype(jnp.bfloat16) for key in keys[:2])
    k, v = (jax.random.normal(key, (B, S, KVH, D), jnp.float32).astype(jnp.bfloat16) for key in keys[2:4])
    q_ids, kv_ids = _segments(keys[4], B, T, S, options.get("docs"), kv_len)
    drop = dropout_keys(keys[5], B, H) if dropout else None

    def grads(q, k, v, do, q_ids, kv_ids, drop):
        out, lse = mosaic_gpu.forward(q, k, v, q_ids, kv_ids, drop, plan)
        return mosaic_gpu.backward(q, k, v, q_ids, kv_ids, drop, out, lse, do, plan)

    dq, dk, dv = jax.jit(grads)(q, k, v, do, q_ids, kv_ids, drop)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    n = kv_len or S
    segment_ids = None if q_ids is None else (q_ids, kv_ids[:, :n])
    _, vjp = jax.vjp(lambda q, k, v: mha_reference(q, k, v, causal=causal, window=window, logit_soft_cap=cap,
                                                   segment_ids=segment_ids, dropout_rate=dropout, dropout_keys=drop),
                     f32(q), f32(k)[:, :n], f32(v)[:, :n])
    for name, x, ref in zip(("dq", "dk", "dv"), (dq, dk[:, :n], dv[:, :n]), vjp(f32(do))):
        assert _rel(f32(x), ref) < 5e-3, (case, name)  # measured 2.2e-3 to 2.5e-3 in bf16


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_flash_attention_api_with_segment_ids(dropout):
    """`kernels.flash_attention(implementation='mosaic_gpu')` with packed segment ids at a length off the tiles
    (200: api.py pads queries, keys and ids to 256, the plan masks keys past 200), with and without dropout (the
    api's keys from `dropout_rng`): output and gradients against `mha_reference`."""
    import kernels

    B, T, H, KVH, D = 1, 200, 2, 1, 64
    keys = jax.random.split(jax.random.key(5), 6)
    q, do = (jax.random.normal(key, (B, T, H, D), jnp.float32).astype(jnp.bfloat16) for key in keys[:2])
    k, v = (jax.random.normal(key, (B, T, KVH, D), jnp.float32).astype(jnp.bfloat16) for key in keys[2:4])
    ids = _packed(keys[4], B, T, 3)

    def attend(q, k, v):
        return kernels.flash_attention(q, k, v, causal=True, segment_ids=ids, implementation="mosaic_gpu",
                                       interpret=True, dropout_rate=dropout, dropout_rng=keys[5] if dropout else None)

    out, vjp = jax.vjp(jax.jit(attend), q, k, v)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    drop = dropout_keys(keys[5], B, H) if dropout else None
    ref, ref_vjp = jax.vjp(lambda q, k, v: mha_reference(q, k, v, causal=True, segment_ids=ids, dropout_rate=dropout,
                                                         dropout_keys=drop), f32(q), f32(k), f32(v))
    assert _rel(f32(out), ref) < 5e-3
    for name, x, r in zip(("dq", "dk", "dv"), vjp(do), ref_vjp(f32(do))):
        assert _rel(f32(x), r) < 5e-3, name


def test_refusals_are_one_line():
    from kernels import mosaic_gpu_compile

    plan = mosaic_gpu_compile.attention_plan(128)
    q = jax.ShapeDtypeStruct((1, 128, 1, 128), jnp.bfloat16)
    assert mosaic_gpu.refusal(q, q, plan) is None
    for why, args in [("float32", (jax.ShapeDtypeStruct(q.shape, jnp.float32), q, plan)),
                      ("head_dim 96", (jax.ShapeDtypeStruct((1, 128, 1, 96), jnp.bfloat16),) * 2 + (plan,)),
                      ("int8 k / v", (q, q, plan, (q, q))),
                      ("at head_dim 256; expected 64", (jax.ShapeDtypeStruct((1, 128, 1, 256), jnp.bfloat16),) * 2
                       + (mosaic_gpu_compile.attention_plan(256, block_q_bwd=128), None, True))]:
        message = mosaic_gpu.refusal(*args)
        assert why in message and "\n" not in message, message
    # Segment ids, the soft cap, dropout and the backward at head dim 256 run (tests above).
    plan = mosaic_gpu_compile.attention_plan(128, logit_soft_cap=30.0, dropout_rate=0.1)
    assert mosaic_gpu.refusal(q, q, plan) is None
    q256 = jax.ShapeDtypeStruct((1, 128, 1, 256), jnp.bfloat16)
    assert mosaic_gpu.refusal(q256, q256, mosaic_gpu_compile.attention_plan(256), backward=True) is None
    q96 = jax.ShapeDtypeStruct((1, 128, 1, 96), jnp.bfloat16)
    with pytest.raises(ValueError, match="head_dim 96"):
        mosaic_gpu.backward(q96, q96, q96, None, None, None, q96, None, q96, plan)


@pytest.fixture(scope="module")
def hopper_reports():
    from kernels import mosaic_gpu_compile

    why = mosaic_gpu_compile.available()
    if why:
        pytest.skip(why)
    return mosaic_gpu_compile.report()


def test_kernels_compile_for_sm90a(hopper_reports):
    """Every production case: its kernels (forward; dq and dk / dv, or dk and dv apart), no spills (the backward's
    loop-invariant wgmma descriptors, hoisted and spilled before `mosaic_gpu._per_step`), shared memory under
    Hopper's 227 KiB, wgmma in the PTX, each one HGMMA in the SASS where nvdisasm is installed, and no ptxas
    advisory (a serialized wgmma is one)."""
    from kernels import mosaic_gpu_compile

    labels = {r.label for r in hopper_reports}
    assert labels == set(mosaic_gpu_compile.attention_cases()), labels
    for r in hopper_reports:
        assert not r.spilled, r
        assert 0 < r.shared_bytes <= mosaic_gpu_compile.MAX_SHARED_BYTES, r
        assert r.wgmma > 0 and r.hgmma in (None, r.wgmma), r
        assert not r.advisories, r
