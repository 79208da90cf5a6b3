"""models.paged_generate: continuous batching over a paged KV cache, against `models.generate` (greedy), and the
scheduler's invariants (every request finished, no page leaked, first come first served, one decode compile)."""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import engine
import models
from tests.prewarmed import run_scripts
from tests.xla_flags import cpu_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(family, **overrides):
    model = models.create_model(family, "tiny", **overrides)
    return model, models.init_params(model, jax.random.PRNGKey(1))


def _requests(seed, count, vocab, max_prompt=12, max_new=10):
    rng = np.random.default_rng(seed)
    return [dict(prompt_ids=rng.integers(1, vocab, int(rng.integers(1, max_prompt + 1))).tolist(),
                 max_new_tokens=int(rng.integers(1, max_new + 1))) for _ in range(count)]


def _reference(model, params, requests, kv_cache_dtype=None):
    """Each request's greedy tokens from one left-padded `models.generate` batch, cut at its length and EOS."""
    T = max(len(r["prompt_ids"]) for r in requests)
    ids = np.zeros((len(requests), T), np.int32)
    mask = np.zeros_like(ids)
    for i, r in enumerate(requests):
        ids[i, T - len(r["prompt_ids"]):] = r["prompt_ids"]
        mask[i, T - len(r["prompt_ids"]):] = 1
    new = np.asarray(models.generate(model, params, jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                                     max_new_tokens=max(r["max_new_tokens"] for r in requests),
                                     kv_cache_dtype=kv_cache_dtype))[:, T:]
    out = []
    for row, r in zip(new.tolist(), requests):
        row = row[:r["max_new_tokens"]]
        if r.get("eos_id") in row:
            row = row[:row.index(r["eos_id"]) + 1]
        out.append(row)
    return out


def _serve(model, params, requests, **kwargs):
    engine = models.PagedEngine(model, params, **kwargs)
    ids = [engine.add_request(**r) for r in requests]
    out = engine.run()
    assert sorted(out) == ids  # every request finished
    assert sorted(engine.free_pages) == list(range(engine.num_pages))  # no page leaked
    assert engine.traces["decode"] == 1  # one decode compile for the whole run
    return engine, [out[i] for i in ids]


def test_greedy_equals_generate_with_fewer_slots_than_requests_eos_and_sampled_neighbours():
    """Greedy requests equal generate's whatever shares their batch; sampled ones follow their own seed (the same
    seed, the same tokens) and top_k=1 samples greedily."""
    model, params = _model("llama")
    requests = _requests(0, 6, model.config.vocab_size)
    plain = _reference(model, params, requests)
    # An EOS met mid-way by two requests: they retire early, their slots and pages go to the waiting ones.
    eos = plain[2][len(plain[2]) // 2]
    for r in requests[:3]:
        r["eos_id"] = eos
    prompt = requests[4]["prompt_ids"]
    requests[4:4] = [dict(prompt_ids=prompt, max_new_tokens=6, temperature=1.0, seed=3),
                     dict(prompt_ids=prompt, max_new_tokens=6, temperature=1.0, top_p=0.9, seed=5)]
    requests += [dict(prompt_ids=prompt, max_new_tokens=6, temperature=1.0, seed=3),
                 dict(prompt_ids=prompt, max_new_tokens=6, temperature=5.0, top_k=1, seed=4)]
    expected = _reference(model, params, requests)
    engine, out = _serve(model, params, requests, max_batch=3, page_size=4, num_pages=16)
    greedy = [i for i, r in enumerate(requests) if r.get("temperature", 0) == 0 or r.get("top_k") == 1]
    assert [out[i] for i in greedy] == [expected[i] for i in greedy]
    assert out[4] == out[8] and len(out[5]) == 6
    assert engine.admission_order == list(range(len(requests)))


def test_a_fixed_prompt_len_prefills_every_prompt_in_one_program(monkeypatch):
    """prompt_len: prompts of 1 ... 12 tokens (buckets 8 and 16) right-padded to 16, one prefill trace where the
    bucketed engine makes two, the same greedy tokens as generate's; a longer prompt refused in one line at
    add_request; generate_continuous sets it to its longest prompt's bucket."""
    model, params = _model("llama")
    requests = _requests(3, 5, model.config.vocab_size)
    assert {len(r["prompt_ids"]) <= 8 for r in requests} == {True, False}  # both buckets
    expected = _reference(model, params, requests)
    bucketed, _ = _serve(model, params, requests, max_batch=2, page_size=4, num_pages=24)
    fixed, out = _serve(model, params, requests, max_batch=2, page_size=4, num_pages=24, prompt_len=16)
    assert out == expected and (bucketed.traces["prefill"], fixed.traces["prefill"]) == (2, 1)
    with pytest.raises(ValueError, match=r"^prompt_ids of 17 tokens; expected at most prompt_len=16 \(the engine's"):
        fixed.add_request([1] * 17, 2)
    with pytest.raises(ValueError, match=r"^prompt_len=0; expected a positive int"):
        models.PagedEngine(model, params, max_batch=2, num_pages=4, prompt_len=0)
    made = []
    monkeypatch.setattr(models.paged_generate, "PagedEngine", lambda *a, **k: made.append(
        models.PagedEngine(*a, **k)) or made[-1])
    assert models.generate_continuous(model, params, requests, max_batch=2, page_size=4, num_pages=24) == expected
    assert made[0].prompt_len == 16 and made[0].traces["prefill"] == 1


def test_scheduler_under_random_arrival_and_a_tight_pool():
    """Requests of random lengths (some repeating an earlier prompt, so sharing its pages while it runs) arriving at
    random steps while others run, 2 slots, a pool just large enough for the longest: every request ends at its own
    limit (or EOS), nothing leaks, each page's reference count is the number of running sequences naming it (never
    negative) and with the free list the held pages partition the pool after every step, admission stays first come
    first served (nobody starves), one decode compile (max_len fixes its shape), and the outputs equal generate's
    (the schedule changes nothing)."""
    model, params = _model("llama")
    requests = _requests(1, 8, model.config.vocab_size, max_prompt=9, max_new=8)
    for i, j in ((1, 0), (2, 0), (6, 5)):
        requests[i]["prompt_ids"] = requests[j]["prompt_ids"]
    for r in requests[::3]:
        r["eos_id"] = 5
    page_size = 2
    need = max(-(-(len(r["prompt_ids"]) + r["max_new_tokens"] - 1) // page_size) for r in requests)
    engine = models.PagedEngine(model, params, max_batch=2, page_size=page_size, num_pages=need + 1, max_len=17)
    arrivals = np.sort(np.random.default_rng(2).integers(0, 12, len(requests)))
    out, ids, step = {}, [], 0
    while len(ids) < len(requests) or engine.busy:
        ids += [engine.add_request(**requests[i]) for i in np.flatnonzero(arrivals == step)]
        out.update(engine.step())
        _check_pool(engine)
        step += 1
    assert sorted(out) == ids == engine.admission_order  # all finished, admitted in arrival order
    assert sorted(engine.free_pages) == list(range(engine.num_pages))
    assert engine.traces["decode"] == 1
    assert engine.prefills < len(requests)  # some prompt was shared
    out = [out[i] for i in ids]
    for r, tokens in zip(requests, out):
        assert len(tokens) == r["max_new_tokens"] or tokens[-1] == r.get("eos_id")
    assert out == _reference(model, params, requests)


def _check_pool(engine):
    """Each page's count is the number of running sequences naming it; held and free pages partition the pool."""
    held = [page for pages in engine.held_pages.values() for page in pages]
    refs = engine.page_refs
    assert refs.min() >= 0
    assert np.array_equal(refs, np.bincount(held, minlength=engine.num_pages)[:engine.num_pages])
    assert len(set(engine.free_pages)) == len(engine.free_pages)
    assert sorted(set(held) | set(engine.free_pages)) == list(range(engine.num_pages))
    assert not set(held) & set(engine.free_pages)


def test_shared_prompt_pages():
    """GRPO-shaped groups (several requests per prompt, 4 slots so some join a prompt while others of it run): the
    greedy ones equal generate's per row, the sampled ones (a seed each) equal the same requests served unshared, a
    shared prompt is prefilled once, fewer pages are held, and the pool stays a partition with counts that match."""
    model, params = _model("llama")
    rng = np.random.default_rng(7)
    partial, full = rng.integers(1, 100, 10).tolist(), rng.integers(1, 100, 12).tolist()  # pages of 4: 2.5 and 3
    requests = [dict(prompt_ids=partial, max_new_tokens=n) for n in (3, 9, 1, 6)]
    requests += [dict(prompt_ids=full, max_new_tokens=n) for n in (5, 8)]
    requests += [dict(prompt_ids=partial[:9], max_new_tokens=7, temperature=1.0, seed=s, top_p=0.9 if s else None)
                 for s in range(4)]
    expected = _reference(model, params, requests[:6])
    served = {}
    for share in (True, False):
        engine = models.PagedEngine(model, params, max_batch=4, page_size=4, num_pages=24, share_prompts=share)
        ids = [engine.add_request(**r) for r in requests]
        out = {}
        while engine.busy:
            out.update(engine.step())
            _check_pool(engine)
        assert sorted(engine.free_pages) == list(range(engine.num_pages))
        served[share] = engine, [out[i] for i in ids]
    (shared, out), (alone, out_alone) = served[True], served[False]
    assert out[:6] == expected
    assert out == out_alone
    assert len(set(map(tuple, out[6:]))) > 1  # the seeds differ, so do the samples
    assert alone.prefills == len(requests) and shared.prefills < alone.prefills
    assert shared.peak_pages < alone.peak_pages


def test_window_shorter_than_the_outputs():
    """Mistral with a window of 4 (paged_attention's window, pages before it never read) over 12 new tokens."""
    model, params = _model("mistral", sliding_window=4)
    requests = [dict(prompt_ids=[3, 9, 27, 81, 115, 17, 51], max_new_tokens=12), dict(prompt_ids=[7, 2],
                                                                                        max_new_tokens=9)]
    _, out = _serve(model, params, requests, max_batch=2, page_size=4, num_pages=8)
    assert out == _reference(model, params, requests)


def test_int8_pages_equal_generates_int8_cache():
    """int8 pages with kernels.quantize_kv's scales decode as generate(kv_cache_dtype='int8') does."""
    model, params = _model("llama")
    requests = _requests(4, 3, model.config.vocab_size)
    requests[1]["prompt_ids"] = requests[0]["prompt_ids"]  # shared int8 pages (and scales), copied on write
    engine, out = _serve(model, params, requests, max_batch=2, page_size=4, num_pages=10, cache_dtype="int8")
    assert engine.cache_dtype == jnp.int8
    assert engine.prefills == len(requests) - 1
    assert out == _reference(model, params, requests, kv_cache_dtype="int8")


@pytest.mark.slow
@pytest.mark.parametrize("family,overrides", [("gemma2", {}), ("llama", dict(scan_layers=True)),
                                              ("qwen3", {}), ("mixtral", {}),
                                              ("gemma2", dict(scan_layers=True, pipeline_virtual_stages=2))])
def test_families(family, overrides):
    """Local / global layers with soft-caps (Gemma 2: the split cache), a scanned stack, q / k norms, experts; a
    scanned Gemma 2 stored for an interleaved pipeline ([V, L / V, ...], its layers one at a time)."""
    model, params = _model(family, **overrides)
    requests = _requests(3, 4, model.config.vocab_size, max_new=12)
    requests[1]["prompt_ids"] = requests[0]["prompt_ids"]  # shared pages (Gemma 2: in both pools)
    engine, out = _serve(model, params, requests, max_batch=2, page_size=4, num_pages=12)
    assert engine.prefills == len(requests) - 1
    assert out == _reference(model, params, requests)


def test_pool_from_a_memory_budget_and_bad_input():
    model, params = _model("llama")
    c = model.config
    per_page = models.page_bytes(model, 8)
    assert per_page == 2 * c.num_layers * c.kv_heads * 8 * c.dim_per_head * 4
    assert models.PagedEngine(model, params, max_batch=2, page_size=8, memory_bytes=10 * per_page + 1).num_pages == 10
    assert models.page_bytes(model, 8, "int8") == 2 * c.num_layers * c.kv_heads * 8 * (c.dim_per_head + 4)
    bad = [(dict(max_batch=0, num_pages=4), r"^max_batch=0; expected a positive int$"),
           (dict(max_batch=1), r"^num_pages=None, memory_bytes=None; expected exactly one of them$"),
           (dict(max_batch=1, memory_bytes=10), r"^num_pages=0 \(memory_bytes=10\); expected at least one page$"),
           (dict(max_batch=1, num_pages=4, cache_dtype="bfloat16"),
            r"^cache_dtype='bfloat16'; expected None \(the compute dtype\) or 'int8'$")]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            models.PagedEngine(model, params, **kwargs)
    engine = models.PagedEngine(model, params, max_batch=1, page_size=4, num_pages=2)
    with pytest.raises(ValueError, match=r"^prompt_ids of shape \(0,\); expected a non-empty 1-D sequence"):
        engine.add_request([], 3)
    with pytest.raises(ValueError, match=r"^max_new_tokens=0; expected a positive int$"):
        engine.add_request([1], 0)
    with pytest.raises(ValueError, match=r"^seed=-1; expected an int in \[0, 2\*\*32\)$"):
        engine.add_request([1], 2, temperature=1.0, seed=-1)
    with pytest.raises(ValueError, match=r"needs 3 pages of 4; expected at most num_pages=2$"):
        engine.add_request([1] * 8, 2)
    with pytest.raises(ValueError, match=r"^a request of 3 prompt \+ 4 new tokens; expected at most max_len=6 tokens$"):
        models.PagedEngine(model, params, max_batch=1, num_pages=4, max_len=6).add_request([1, 2, 3], 4)
    with pytest.raises(ValueError, match=r"^model=T5; expected a decoder-only model"):
        models.PagedEngine(models.create_model("t5", "tiny"), {}, max_batch=1, num_pages=1)


@pytest.mark.slow
def test_parameters_sharded_over_a_mesh():
    """Parameters on data 2 x fsdp 2 x model 2 (auto_layout): the same tokens as on one device; the pools on that
    mesh with their kv heads over `model`, before and after the run."""
    model, params = _model("llama")
    mesh = engine.make_mesh(data=2, fsdp=2, model=2)
    sharded = models.init_params(model, jax.random.PRNGKey(1), layout=engine.auto_layout(mesh))
    requests = _requests(5, 3, model.config.vocab_size)
    settings = dict(max_batch=2, page_size=4, num_pages=10)
    paged = models.PagedEngine(model, sharded, **settings)
    heads = lambda: {x.sharding.spec for x in jax.tree.leaves(paged.pools)}  # noqa: E731
    assert heads() == {jax.sharding.PartitionSpec("model")}
    ids = [paged.add_request(**r) for r in requests]
    out = paged.run()
    assert [out[i] for i in ids] == models.generate_continuous(model, params, requests, **settings)
    assert heads() == {jax.sharding.PartitionSpec("model")}


@pytest.mark.slow
def test_generate_script_paged_engine_equals_static(tmp_path):
    """scripts/generate.py --engine=paged on a tiny LLaMA Hugging Face directory: the same greedy text as the static
    path, prompts from --prompts_file (two equal, so sharing pages) on fewer slots than prompts; beam search refused
    in one line."""
    model = models.create_model("llama", "tiny", vocab_size=320)  # byte-level tokens need 320
    models.save_pretrained(model, models.init_params(model, jax.random.PRNGKey(0)), str(tmp_path / "hf"))
    (tmp_path / "prompts.txt").write_text("the cat\nowl\n\nthe cat\nsat on a mat\n")
    args = [f"--init_from={tmp_path / 'hf'}", "--tokenizer=byte", f"--prompts_file={tmp_path / 'prompts.txt'}",
            "--max_new_tokens=6", "--batch_size=2"]
    env = dict(os.environ, XLA_FLAGS=cpu_devices(8), JAX_PLATFORMS="cpu")
    (code, static, err), (paged_code, paged, paged_err), (beams_code, _, beams_err) = run_scripts(
        [("generate.py", *args), ("generate.py", *args, "--engine=paged", "--page_size=4"),
         ("generate.py", *args, "--engine=paged", "--num_beams=2")], env, ROOT)
    assert code == 0 and paged_code == 0, err[-2000:] + paged_err[-2000:]
    assert re.findall(r"^--- '(.*)':$", paged, re.M) == ["the cat", "owl", "the cat", "sat on a mat"]
    assert paged == static
    assert beams_code == 2 and beams_err.strip().splitlines()[-1] == (
        "error: --engine=paged with a Llama, --num_beams=2, --kv_cache_dtype=auto; expected a decoder-only model, "
        "--num_beams=1 and --kv_cache_dtype auto or int8")


def _ops(lowered):
    """StableHLO operations in a lowered program's text."""
    return len(re.findall(r"= (?:\"?)stablehlo\.", lowered.as_text()))


def test_generation_compiles_a_bounded_set_of_programs():
    """Compile time scales with the programs and their size, not the workload: the static path's program does not grow
    with the new tokens (a while loop) or, scanned, with the layers; the paged engine compiles one decode step and one
    prefill per prompt-length bucket, and a second request mix over the same buckets compiles nothing."""
    import importlib
    static = importlib.import_module("models.generate")
    sizes = {}
    for layers, new in ((2, 4), (4, 4), (2, 16)):
        model, params = _model("llama", num_layers=layers, scan_layers=True)
        ids = jax.ShapeDtypeStruct((2, 8), jnp.int32)
        run = static._compiled(model, new, 0.0, None, None, None, 0, None)
        sizes[layers, new] = _ops(run.trace(params, ids, ids, jax.random.PRNGKey(0)).lower())
    assert sizes[2, 4] == sizes[4, 4] == sizes[2, 16], sizes

    compiled = []
    listener = lambda event, seconds, **_: compiled.append(event)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        model, params = _model("llama")
        engine = models.PagedEngine(model, params, max_batch=3, page_size=4, num_pages=64, max_len=40)
        for seed in (0, 1):
            compiled.clear()
            rng = np.random.default_rng(seed)  # prompts of 1-24 tokens: buckets 8, 16, 32, every one in both mixes
            lengths = [1, 9, 17, *rng.integers(1, 25, 5)]
            for n in lengths:
                engine.add_request(rng.integers(1, model.config.vocab_size, n).tolist(), int(rng.integers(1, 12)))
            engine.run()
            programs = compiled.count("/jax/core/compile/backend_compile_duration")
            if seed == 0:
                assert engine.traces == {"decode": 1, "prefill": 3, "sample": 1}, engine.traces
                assert programs <= 8, programs  # decode, 3 prefills, sampling, page copy (6 with JAX 0.10)
            else:
                assert programs == 0 and engine.traces == {"decode": 1, "prefill": 3, "sample": 1}, (programs,
                                                                                                     engine.traces)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.slow
def test_paged_layers_run_as_one_scan_and_sampling_compiles_once():
    """A scanned model's paged decode step and prefill are the same program at 2 and 8 layers (one scan of the block
    carrying the folded pool; unscanned, the layers unroll and the program grows), and a run mixing greedy and
    sampled requests compiles one decode step and one sampling program (first tokens and decoded ones), its greedy
    tokens equal to generate's."""
    sizes = {}
    for scan in (True, False):
        for layers in (2, 8):
            model, params = _model("llama", num_layers=layers, scan_layers=scan)
            paged = models.PagedEngine(model, params, max_batch=2, page_size=4, num_pages=8, max_len=16)
            ints = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
            table = ints(2, paged._table_width)
            decode = paged._decode.trace(params, paged.pools, ints(2), table, ints(2), ints(2)).lower()
            prefill = paged._prefill.trace(params, paged.pools, paged._logits, ints(1, 8), ints(1, 8), table[:1],
                                           np.int32(0), np.int32(0)).lower()
            sizes[scan, layers] = _ops(decode), _ops(prefill)
    assert sizes[True, 2] == sizes[True, 8], sizes
    assert all(u > s for u, s in zip(sizes[False, 8], sizes[True, 8])), sizes

    model, params = _model("llama", scan_layers=True)
    requests = _requests(6, 5, model.config.vocab_size)
    requests[1]["prompt_ids"] = requests[0]["prompt_ids"]
    requests += [dict(prompt_ids=requests[0]["prompt_ids"], max_new_tokens=5, temperature=1.0, seed=s) for s in (1, 2)]
    engine, out = _serve(model, params, requests, max_batch=3, page_size=4, num_pages=24, max_len=24)
    assert engine.traces["sample"] == 1 and engine.traces["decode"] == 1, engine.traces  # traced once: one program
    assert out[:5] == _reference(model, params, requests[:5])
