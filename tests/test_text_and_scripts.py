"""engine.text (packing, pairs, the plain and fused losses) and the scripts' helpers (engine.tasks.script_flags,
model_start, run_record, mesh_choice: flags, models, workdirs) in process; the scripts end to end are in
tests/test_scripts.py."""
import json
import logging
import os
import pickle
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import models
from engine.tasks import lm, mesh_choice, model_start, run_record, script_flags, seq2seq, text_data
from tests.targets import jaxpr_shapes


def test_pack_segments_and_labels():
    tok = text_data.ByteTokenizer()
    rows = text_data.pack(["abc", "defgh", "ij"], tok, seq_len=5)
    # abc<eos> def | gh<eos> ij<eos> | padding
    assert [r["tokens"].tolist() for r in rows] == [
        [97, 98, 99, 258, 100, 101], [102, 103, 104, 258, 105, 106], [258, 256, 256, 256, 256, 256]]
    assert [r["segment_ids"].tolist() for r in rows] == [[1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 2, 2], [1, 0, 0, 0, 0, 0]]
    batch = lm.collate_lm(rows)
    assert batch["input_ids"].shape == (3, 5)
    # Labels stop at document boundaries and padding.
    assert batch["labels"][0].tolist() == [98, 99, 258, -100, 101]
    assert batch["labels"][2].tolist() == [-100] * 5


def test_whole_rows_collate_without_segment_ids():
    """Rows of tokens alone: every next token is a label, no segment ids (the model then attends without them);
    a batch mixing both kinds of row is refused in one line."""
    rows = [{"tokens": np.arange(6, dtype=np.int32) + 10 * i} for i in range(2)]
    batch = lm.collate_lm(rows)
    assert set(batch) == {"input_ids", "labels"} and batch["labels"].tolist() == [[1, 2, 3, 4, 5], [11, 12, 13, 14, 15]]
    with pytest.raises(ValueError, match=r"examples: row 1 has no 'segment_ids' and row 0 has; expected every row"):
        lm.collate_lm([{**rows[0], "segment_ids": np.ones(6, np.int32)}, rows[1]])


def test_read_texts_and_errors(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n"y"\n\n')
    assert text_data.read_texts([str(tmp_path / "*")]) == ["hello", "x", "y"]
    with pytest.raises(FileNotFoundError, match=r"data: '/nonexistent/\*.txt' matches no file"):
        text_data.read_texts("/nonexistent/*.txt")
    (tmp_path / "c.jsonl").write_text('{"body": 1}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:1 has no 'text' field"):
        text_data.read_texts(str(tmp_path / "c.jsonl"))


def test_token_windows_read_a_tokenised_corpus_as_packed_rows(tmp_path):
    """write_tokens streams documents into tokens.bin; TokenWindows reads windows of it in pack's row format (here
    the same first row as pack's), slices are views, and engine.data batches it exactly like the list of its rows."""
    tok, out = text_data.ByteTokenizer(), str(tmp_path / "tokens")
    meta = text_data.write_tokens(iter(["abc", "defgh", "ij"]), tok, out, chunk_tokens=4)
    assert meta == {"dtype": "uint16", "num_tokens": 13, "num_documents": 3, "max_id": 258, "eos_id": 258,
                    "tokenizer": {"kind": "byte"}}
    rows = text_data.TokenWindows(out, seq_len=5)  # a b c E d e f g h E i j E: windows [0:6], [5:11]
    assert len(rows) == 2 and rows[-1]["tokens"].tolist() == [101, 102, 103, 104, 258, 105]
    assert rows[0]["tokens"].tolist() == text_data.pack(["abc", "defgh", "ij"], tok, 5)[0]["tokens"].tolist()
    assert [r["segment_ids"].tolist() for r in rows] == [[1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 2]]
    assert lm.collate_lm(list(rows))["labels"].tolist() == [[98, 99, 258, -100, 101], [102, 103, 104, 258, -100]]
    assert len(rows[1:]) == 1 and rows[1:][0]["tokens"].tolist() == rows[1]["tokens"].tolist()
    sent = pickle.dumps(rows[1:])  # what a data worker receives: the directory and range, mapped again there
    assert len(sent) < 1000 and pickle.loads(sent)[0]["tokens"].tolist() == rows[1]["tokens"].tolist()
    with pytest.raises(ValueError, match=r"only contiguous slices"):
        rows[::2]
    text_data.check_token_dir(out, tok, vocab_size=320)
    with pytest.raises(ValueError, match=r"tokenised with a byte tokenizer that is not this model's \(WordTokenizer"):
        text_data.check_token_dir(out, text_data.WordTokenizer(["a"]), vocab_size=320)
    with pytest.raises(ValueError, match=r"holds token id 258; expected ids below the model's vocab_size=256"):
        text_data.check_token_dir(out, tok, vocab_size=256)
    with pytest.raises(FileNotFoundError, match=r"has no meta.json; expected a directory written by"):
        text_data.TokenWindows(str(tmp_path), seq_len=5)

    import engine  # noqa: PLC0415
    from engine import data  # noqa: PLC0415

    text_data.write_tokens(text_data.default_corpus(max_bytes=4000), tok, str(tmp_path / "big"))
    windows = text_data.TokenWindows(str(tmp_path / "big"), seq_len=16)
    mesh = engine.make_mesh(data=4, model=2)
    for epoch in (0, 1):
        batches = [data.iterate_batches(mesh, source, lm.collate_lm, per_device_batch_size=2, accumulate=2,
                                        seed=3, epoch=epoch, start_batch=1) for source in (windows, list(windows))]
        pairs = list(zip(*batches))
        assert len(pairs) == len(windows) // 16 - 1
        for (i, n, a), (j, m, b) in pairs:
            assert (i, n) == (j, m)
            for k in a:
                np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))


def test_default_corpus_is_local_and_sized():
    docs = text_data.default_corpus(max_bytes=50_000)
    assert sum(map(len, docs)) == 50_000 and "import" in "".join(docs)


def test_parse_mesh():
    assert script_flags.parse_mesh("2,-1,2") == {"data": 2, "fsdp": -1, "model": 2}
    assert script_flags.parse_mesh("2,1,1,4") == {"data": 2, "fsdp": 1, "model": 1, "expert": 4}
    with pytest.raises(ValueError, match=r"--mesh='2,2'; expected three or four integers data,fsdp,model\[,expert\]"):
        script_flags.parse_mesh("2,2")


def test_read_pairs_and_errors(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"input": "x y", "target": "y x"}\n\n')
    assert seq2seq.read_pairs(str(tmp_path / "a.jsonl")) == [{"input": "x y", "target": "y x"}]
    (tmp_path / "b.jsonl").write_text('{"input": "x"}\n')
    with pytest.raises(ValueError, match=r"b.jsonl:1 is not an object with string fields 'input' and 'target'"):
        seq2seq.read_pairs(str(tmp_path / "b.jsonl"))
    (tmp_path / "c.jsonl").write_text('{"input": "x", "target": "y"}\n{oops\n')
    with pytest.raises(ValueError, match=r"c.jsonl:2 is not JSON"):
        seq2seq.read_pairs(str(tmp_path / "c.jsonl"))


def test_toy_pairs_encode_collate_and_exact_match():
    pairs = seq2seq.toy_pairs(50, seed=3)
    assert pairs == seq2seq.toy_pairs(50, seed=3) and pairs != seq2seq.toy_pairs(50, seed=4)
    for p in pairs:
        words = p["input"].split()
        assert 3 <= len(words) <= 6 and len(set(words)) == len(words) and p["target"].split() == sorted(words)
    tok = text_data.WordTokenizer(text_data.TOY_WORDS)
    assert tok.decode(tok.encode(pairs[0]["target"])) == pairs[0]["target"]
    examples, cut = seq2seq.encode_pairs(pairs[:2], tok, max_input_len=8, max_target_len=4, decoder_start_id=tok.bos_id)
    target = tok.encode(pairs[0]["target"]) + [tok.eos_id]
    batch = seq2seq.collate_seq2seq(examples)
    assert batch["input_ids"].shape == (2, 8) and batch["labels"].shape == (2, 4)
    assert cut == sum(len(p["target"].split()) + 1 > 4 for p in pairs[:2])
    n = min(len(target), 4)
    assert batch["labels"][0, :n].tolist() == target[:n]
    assert batch["decoder_input_ids"][0, :n].tolist() == ([tok.bos_id] + target)[:n]  # shifted right
    assert batch["attention_mask"][0].sum() == len(pairs[0]["input"].split()) + 1
    good = [np.r_[e["labels"][e["labels"] >= 0], [tok.pad_id] * 3] for e in examples]
    assert seq2seq.exact_match(examples, good, tok.eos_id) == {"exact_match": 1.0}
    bad = [good[0], np.roll(good[1], 1)]
    assert seq2seq.exact_match(examples, bad, tok.eos_id) == {"exact_match": 0.5}


def test_pack_pairs_keeps_whole_pairs_apart_and_t5_loss_unchanged():
    """Packed pairs (several per row, numbered segments) give T5 the same per-token losses as one pair per row: each
    target attends to its own input (cross-attention by segment) and its own earlier tokens only, and the relative
    position bias depends on distances within a pair only. Training mode (dropout off) and the eval path agree."""
    tok = text_data.WordTokenizer(text_data.TOY_WORDS)
    model = models.create_model("t5", "tiny", dropout_rate=0.0)
    examples, _ = seq2seq.encode_pairs(seq2seq.toy_pairs(12, seed=5), tok, max_input_len=16, max_target_len=16,
                                    decoder_start_id=model.config.decoder_start_token_id)
    rows = seq2seq.pack_pairs(examples)
    assert 3 <= len(rows) < len(examples)  # pairs of 4-7 tokens: two or three per 16-token row
    for key in ("input_ids", "labels", "decoder_input_ids"):  # every pair's tokens, whole and in order
        real = lambda e, k=key: e[k][(e["attention_mask"] if k == "input_ids" else e["labels"] + 100) != 0]
        assert np.concatenate([real(r) for r in rows]).tolist() == np.concatenate([real(e) for e in examples]).tolist()
    first = rows[0]
    assert first["attention_mask"].max() >= 2 and first["decoder_attention_mask"].max() == first["attention_mask"].max()
    assert np.all((first["labels"] == -100) == (first["decoder_attention_mask"] == 0))
    params = models.init_params(model, jax.random.PRNGKey(0))
    loss_fn = jax.jit(seq2seq.seq2seq_loss_fn(model), static_argnums=3)
    (packed, packed_metrics), (plain, plain_metrics) = (
        loss_fn(params, seq2seq.collate_seq2seq(batch), jax.random.key(0), True) for batch in (rows, examples))
    assert packed_metrics["tokens"] == plain_metrics["tokens"]
    np.testing.assert_allclose(packed, plain, rtol=1e-5)
    assert seq2seq.pack_pairs([]) == []


def _decoder_batch(vocab):
    rng = np.random.RandomState(0)
    seg = np.array([1] * 9 + [2] * 6 + [0] * 2, np.int32)
    return lm.collate_lm([{"tokens": rng.randint(0, vocab, 17).astype(np.int32), "segment_ids": seg}
                            for _ in range(3)])


def _seq2seq_batch(model):
    tok = text_data.WordTokenizer(text_data.TOY_WORDS)
    examples, _ = seq2seq.encode_pairs(seq2seq.toy_pairs(3, 0), tok, max_input_len=8, max_target_len=8,
                                    decoder_start_id=model.config.decoder_start_token_id)
    return seq2seq.collate_seq2seq(examples)


_SLOW = pytest.mark.slow
_TIED = {"tie_word_embeddings": True}


@pytest.mark.parametrize("family,overrides,implementation", [
    ("llama", {}, "xla"), ("gptj", {}, "chunked"), pytest.param("t5", {}, "chunked", marks=_SLOW),
    pytest.param("gptj", {}, "xla", marks=_SLOW), pytest.param("t5", {}, "xla", marks=_SLOW),
    pytest.param("opt", {}, "triton", marks=_SLOW),
    pytest.param("llama", _TIED, "xla", marks=_SLOW), pytest.param("llama", {}, "triton", marks=_SLOW),
    pytest.param("gptj", {}, "triton", marks=_SLOW), pytest.param("opt", {}, "xla", marks=_SLOW),
    pytest.param("opt", {"tie_word_embeddings": False}, "xla", marks=_SLOW),
    pytest.param("t5", {"tie_word_embeddings": True, "scale_decoder_outputs": True}, "xla", marks=_SLOW),
    pytest.param("t5", {}, "triton", marks=_SLOW)])
def test_fused_loss_matches_plain_logits(family, overrides, implementation):
    """The fused head + loss (kernels.linear_cross_entropy on the hidden states; 'chunked':
    kernels.linear_cross_entropy_sum, gradients taken in the forward) gives the plain path's loss and gradients in
    fp32, for tied heads (llama tied, opt, t5 v1.0), untied heads and GPT-J's biased head; 'triton' runs in Pallas's
    interpreter."""
    model = models.create_model(family, "tiny", **overrides)
    params = models.init_params(model, jax.random.PRNGKey(1))
    if family == "gptj":  # a non-zero head bias, so that folding it into the kernel is tested
        params["lm_head"]["bias"] = jax.random.normal(jax.random.PRNGKey(2), params["lm_head"]["bias"].shape)
    make, batch = ((seq2seq.seq2seq_loss_fn, _seq2seq_batch(model)) if family == "t5"
                   else (lm.lm_loss_fn, _decoder_batch(model.config.vocab_size)))
    results = []
    for impl in (None, implementation):
        loss_fn = make(model, impl, interpret=True)
        with jax.default_matmul_precision("highest"):
            results.append(jax.jit(jax.value_and_grad(lambda p: loss_fn(p, batch, None, True), has_aux=True))(params))
    ((loss, metrics), grads), ((fused_loss, fused_metrics), fused_grads) = results
    assert "accuracy" in metrics and float(metrics["tokens"]) == (batch["labels"] >= 0).sum()
    assert "accuracy" not in fused_metrics and fused_metrics["tokens"] == metrics["tokens"]
    np.testing.assert_allclose(fused_loss, loss, rtol=1e-6)
    # Summation order differs (blockwise over the vocabulary): differences ~1e-6 of gradients up to ~3 (T5).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=5e-6), fused_grads, grads)


def test_fused_loss_has_no_logits_forward_or_backward():
    model = models.create_model("llama", "tiny", vocab_size=200)  # a size no other dim has
    params = models.init_params(model, jax.random.PRNGKey(1))
    batch = _decoder_batch(model.config.vocab_size)
    (B, T), V = batch["input_ids"].shape, model.config.vocab_size

    def logits_like(shapes):
        return [s for s in shapes if V in s and (B * T in s or (B in s and T in s))]
    for implementation, expect_logits in ((None, True), ("xla", False)):
        loss_fn = lm.lm_loss_fn(model, implementation)
        jaxpr = jax.make_jaxpr(jax.grad(lambda p: loss_fn(p, batch, None, True)[0]))(params)
        assert bool(logits_like(jaxpr_shapes(jaxpr.jaxpr))) == expect_logits, implementation


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_plain_cross_entropy_and_its_one_pass_backward(dtype):
    """`lm.cross_entropy` (the plain-logits loss) equals optax's in value and gradient (which comes back in the
    logits' dtype), and its backward holds no scatter: the label's logit differentiated as written scatters into a
    float32 [tokens, vocab] of zeros."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 7, 50)) * 3, dtype)
    labels = jnp.asarray(rng.integers(0, 50, (3, 7)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(3, 7)), jnp.float32)
    ref = lambda x: (optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
        x.astype(jnp.float32), labels) * weights).sum()
    ours = lambda x: (lm.cross_entropy(x, labels) * weights).sum()  # noqa: E731
    np.testing.assert_allclose(ours(logits), ref(logits), rtol=1e-6)
    grad = jax.grad(ours)(logits)
    assert grad.dtype == dtype
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(jax.grad(ref)(logits), np.float32),
                               atol=1e-6 if dtype == jnp.float32 else 1e-2)
    assert "scatter" not in str(jax.make_jaxpr(jax.grad(ours))(logits))
    assert "scatter" in str(jax.make_jaxpr(jax.grad(ref))(logits))  # what it replaces


def test_loss_implementation_is_checked():
    model = models.create_model("llama", "tiny")
    with pytest.raises(ValueError, match=r"loss implementation='cuda'; expected one of"):
        lm.lm_loss_fn(model, "cuda")
    batch = _decoder_batch(model.config.vocab_size)
    with pytest.raises(ValueError, match=r"^loss implementation='chunked' gives a summed loss"):
        lm.token_losses(model, models.init_params(model), jnp.zeros((*batch["labels"].shape, 64)), batch["labels"],
                        "chunked")


def test_create_model_and_run_json(tmp_path):
    model = model_start.create_model("llama", "tiny", {"hidden_size": 32, "rope_scaling": [["factor", 2.0],
                                                                                  ["rope_type", "linear"]]},
                                     families=["llama"])
    assert model.config.hidden_size == 32 and model.config.rope_scaling == (("factor", 2.0), ("rope_type", "linear"))
    (tmp_path / "c.json").write_text('{"hidden_size": 48, "num_heads": 4, "num_layers": 1}')
    assert model_start.create_model("opt", str(tmp_path / "c.json"), families=["opt"]).config.hidden_size == 48
    with pytest.raises(ValueError, match=r"llama config has no field\(s\) \['width'\]"):
        model_start.create_model("llama", "tiny", {"width": 3}, families=["llama"])
    with pytest.raises(ValueError, match=r"--model='t5'; expected one of \['llama'\]"):
        model_start.create_model("t5", "tiny", families=["llama"])
    with pytest.raises(FileNotFoundError, match=r"--model_config=/nope.json: no such file"):
        model_start.create_model("llama", "/nope.json", families=["llama"])

    tok = text_data.WordTokenizer(["a", "b"])
    run_record.save_run(str(tmp_path / "w"), "lm", model, tok)
    run_record.save_run(str(tmp_path / "w"), "lm", model, tok)  # the same run again: fine
    task, again, tok2 = run_record.load_run(str(tmp_path / "w"), scan_layers=True)
    assert task == "lm" and again.config == model.config.__class__(**{**vars(model.config), "scan_layers": True})
    assert tok2.words == ["a", "b"] and tok2.encode("b a c") == [5, 4, 3]
    other = model_start.create_model("llama", "tiny", {"hidden_size": 64}, families=["llama"])
    with pytest.raises(ValueError, match=r"another model \(llama, fields \['hidden_size', 'rope_scaling'\] differ"):
        run_record.save_run(str(tmp_path / "w"), "lm", other, tok)
    with pytest.raises(FileNotFoundError, match=r"has no run.json"):
        run_record.load_run(str(tmp_path))
    # A run.json from before the LoRA fields were recorded: its model is the one without adapters.
    run_file = tmp_path / "w" / "run.json"
    old = json.loads(run_file.read_text())
    old["config"] = {k: v for k, v in old["config"].items() if not k.startswith("lora_")}
    run_file.write_text(json.dumps(old))
    run_record.save_run(str(tmp_path / "w"), "lm", model, tok)
    adapted = model.clone(config=model.config.__class__(**{**vars(model.config), "lora_rank": 4}))
    with pytest.raises(ValueError, match=r"fields \['lora_rank'\] differ"):
        run_record.save_run(str(tmp_path / "w"), "lm", adapted, tok)
    # FP8 amax histories are parameters: a run with them is another model, and the error names the flags it ran with.
    delayed = model.clone(config=model.config.__class__(**{**vars(model.config), "fp8": True, "fp8_history": 16}))
    with pytest.raises(ValueError, match=r"fields \['fp8_history'\] differ.*: it ran with --fp8_history=0 \(no FP8"):
        run_record.save_run(str(tmp_path / "w"), "lm", delayed, tok)
    run_record.save_run(str(tmp_path / "d"), "lm", delayed, tok)
    with pytest.raises(ValueError, match=r"fields \['fp8_history'\] differ.*: it ran with --fp8 --fp8_history=16$"):
        run_record.save_run(str(tmp_path / "d"), "lm", model, tok)


def test_the_data_a_run_trained_on_binds_its_resume(tmp_path, caplog):
    """`run_record.data_digest` changes with the rows (a file appended to, another --seq_len, an edited row) and
    `check_data` refuses a resume on other rows in one line, or under change='continue' logs it; a new run, or
    one with no checkpoint yet, binds nothing; a mixture of other weights is left to the mixture's own check."""
    tok, workdir = text_data.ByteTokenizer(), str(tmp_path / "w")
    docs = text_data.default_corpus(max_bytes=6_000)
    rows = text_data.pack(docs, tok, 32)
    data = run_record.data_digest(rows, 32)
    assert data["about"] == f"{len(rows)} rows of 33 tokens" and run_record.data_digest(list(rows), 32) == data
    model = model_start.create_model("llama", "tiny", families=["llama"])
    run_record.save_run(workdir, "lm", model, tok, data=data)
    other = run_record.data_digest(text_data.pack(docs + ["more text"], tok, 32), 32)
    run_record.check_data(workdir, other, "a.txt", seq_len=32)  # no checkpoint yet: a new run
    os.makedirs(os.path.join(workdir, "checkpoints", "4"))
    run_record.check_data(workdir, data, "a.txt", seq_len=32)
    edited = [dict(r) for r in rows]
    edited[-1] = {**edited[-1], "tokens": edited[-1]["tokens"][::-1].copy()}
    changed = [other, run_record.data_digest(text_data.pack(docs, tok, 48), 48), run_record.data_digest(edited, 32)]
    for new, what in zip(changed, [f"then {len(rows)} rows of 33 tokens, now {len(rows) + 1} rows of 33 tokens",
                                   f"then {len(rows)} rows of 33 tokens, now", f"{len(rows)} rows of 33 tokens both, "
                                   "with other contents"]):
        with pytest.raises(ValueError, match=rf"^--data=a.txt \(--seq_len=32\) is not the data the run in {workdir} "
                                             rf"trained on \({what}.*\): its eval rows and the epoch's order would "
                                             r"change; expected the same files and --seq_len to resume it, "
                                             r"--data_change=continue to train on from step 4 on this data \(eval "
                                             r"rows drawn again\), or another --workdir$"):
            run_record.check_data(workdir, new, "a.txt", seq_len=32)
    with caplog.at_level(logging.WARNING):
        run_record.check_data(workdir, other, "a.txt", seq_len=32, change="continue")
    assert "--data_change=continue: it trains on from step 4 on this data" in caplog.text
    windows = rows[:16]
    mixed = run_record.data_digest(windows, 32, stream="the mixture", mixture=[0.5, 0.5, "text", "text"])
    run_record.save_run(workdir, "lm", model, tok, data=mixed)
    run_record.check_data(workdir, data, "a.txt", seq_len=32)  # the mixture binds only once it saved ...
    os.makedirs(os.path.join(workdir, "checkpoints", "8"))  # ... as it has now
    reweighed = run_record.data_digest(rows[1:17], 32, stream="the mixture", mixture=[0.7, 0.3, "text", "text"])
    run_record.check_data(workdir, reweighed, "a:7,b:3", seq_len=32)  # the mixture's own check names both
    with pytest.raises(ValueError, match=r"\(the mixture's first 16 windows of 33 tokens both, with other contents"):
        run_record.check_data(workdir, {**reweighed, "mixture": mixed["mixture"]}, "a:1,b:1", seq_len=32)


def test_eval_records_that_training_sees_are_refused_or_named(tmp_path, caplog):
    pairs = [{"prompt": f"p{i}", "response": "r"} for i in range(6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (tmp_path / "dev.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs[4:] + [{"prompt": "new",
                                                                                           "response": "r"}]))
    train, dev = str(tmp_path / "train.jsonl"), str(tmp_path / "dev.jsonl")
    with pytest.raises(ValueError, match=rf"^--eval_data names {train}, which --data trains on; expected held-out "
                                         r"files, or no --eval_data \(the last --eval_size pairs of --data are held "
                                         r"out\)$"):
        script_flags.check_held_out(pairs, pairs, "pairs", [train], [f"{tmp_path}/*ain.jsonl"])
    with caplog.at_level(logging.WARNING):
        script_flags.check_held_out(pairs, pairs[4:], "pairs", [train], [dev])
    assert "2 of the 2 --eval_data pairs are also training pairs: their eval loss is not held out" in caplog.text


def test_optimizer_flags_schedules_and_errors():
    from absl import flags  # noqa: PLC0415

    FLAGS = flags.FLAGS
    if "lr_schedule" not in FLAGS:
        script_flags.define_training_flags(workdir="w", max_steps=10, learning_rate=1.0, warmup_steps=2, log_every=1,
                                           save_every=1)
    try:
        for args, want in [([], {0: 0.0, 1: 0.5, 2: 1.0, 10: 0.1}),  # cosine to 10%
                           (["--lr_schedule=linear"], {1: 0.5, 2: 1.0, 6: 0.55, 10: 0.1}),
                           (["--lr_schedule=linear", "--min_learning_rate_ratio=0"], {6: 0.5, 10: 0.0}),
                           (["--lr_schedule=constant"], {1: 0.5, 2: 1.0, 10: 1.0, 50: 1.0})]:
            FLAGS.unparse_flags()
            FLAGS(["prog", "--max_steps=10", "--learning_rate=1.0", "--warmup_steps=2", *args])
            schedule = script_flags.lr_schedule(1.0)
            for step, lr in want.items():
                assert float(schedule(step)) == pytest.approx(lr, abs=1e-6), (args, step)
        FLAGS.unparse_flags()
        FLAGS(["prog", "--max_grad_norm=0", "--adam_b2=0.95"])
        state = script_flags.optimizer().init({"w": np.zeros(2, np.float32)})
        assert type(state) is not tuple  # AdamW alone, not a chain behind a clip
        assert float(state.hyperparams["b2"]) == pytest.approx(0.95)
        for bad, message in [("--adam_b2=1.0", "--adam_b2=1.0; expected in [0, 1)"),
                             ("--max_grad_norm=-1", "--max_grad_norm=-1.0; expected >= 0 (0: no clipping)"),
                             ("--min_learning_rate_ratio=2", "--min_learning_rate_ratio=2.0; expected in [0, 1]")]:
            FLAGS.unparse_flags()
            FLAGS(["prog", bad])
            with pytest.raises(ValueError, match=re.escape(message)):
                script_flags.optimizer()
    finally:
        FLAGS.unparse_flags()


def test_diloco_runs_say_when_they_end_between_outer_steps_and_note_changed_diloco_flags(tmp_path, caplog):
    """A DiLoCo run whose --max_steps falls between two outer steps (or whose last one, overlapped, would be taken
    in the step after) ends with the global model of its last outer step: one warning line names it. A resume under
    another --diloco_inner_steps, outer learning rate or wire format gets the changed-flag warning line."""
    from absl import flags  # noqa: PLC0415

    FLAGS = flags.FLAGS
    if "lr_schedule" not in FLAGS:
        script_flags.define_training_flags(workdir="w", max_steps=10, learning_rate=1.0, warmup_steps=2, log_every=1,
                                           save_every=1)
    cases = {("--max_steps=6",): "--max_steps=6 is not a multiple of --diloco_inner_steps=4: the model the run ends "
                                 "with (its checkpoint's parameters, the eval after training, generate.py and "
                                 "export_hf.py) is its global model of step 4, its last outer step; the replicas' 2 "
                                 "steps since reach it at the next outer step",
             ("--max_steps=8", "--diloco_overlap"): "with --diloco_overlap an outer step is taken in the step after "
                                                    "it falls due, so step 8's is not: the model the run ends with",
             ("--max_steps=3",): "is the initial model (no outer step yet); the replicas' 3 steps since",
             ("--max_steps=8",): None, ("--max_steps=6", "--diloco_fragments=2"): None}
    workdir = str(tmp_path / "w")
    try:
        for args, warning in cases.items():
            FLAGS.unparse_flags()
            FLAGS(["prog", "--diloco_inner_steps=4", *args])
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                script_flags.check_diloco_flags()
            assert (warning in caplog.text) if warning else "outer step" not in caplog.text, (args, caplog.text)
        model = model_start.create_model("llama", "tiny", {"hidden_size": 32}, families=["llama"])
        FLAGS.unparse_flags()
        FLAGS(["prog", f"--workdir={workdir}", "--diloco_inner_steps=4"])
        run_record.save_run(workdir, "lm", model, text_data.WordTokenizer(["a"]))
        os.makedirs(os.path.join(workdir, "checkpoints", "4"))  # a checkpoint binds the record
        FLAGS.unparse_flags()
        FLAGS(["prog", f"--workdir={workdir}", "--diloco_inner_steps=8", "--diloco_outer_learning_rate=0.5"])
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            run_record.save_run(workdir, "lm", model, text_data.WordTokenizer(["a"]))
        for changed in ("--diloco_inner_steps=8 where the run in", "--diloco_outer_learning_rate=0.5 where the run in"):
            assert changed in caplog.text, caplog.text
    finally:
        FLAGS.unparse_flags()


def test_a_longer_max_steps_keeps_or_rewarms_the_schedule_the_run_started_with(tmp_path):
    """`make train` then `make train ARGS=--max_steps=...`: the cosine's horizon was the first run's --max_steps, so
    stretching it would jump the rate (0.1x to about 0.58x of the peak); the run keeps its schedule, or starts a
    second warm-up and decay with --lr_extension=rewarm, and run.json records which. A start that saved no
    checkpoint binds nothing (a first run's, or an extension's: the record the last checkpoint was saved under
    binds), and a re-run with fewer steps than were trained moves no later cycle's start back."""
    from absl import flags  # noqa: PLC0415

    FLAGS = flags.FLAGS
    if "lr_schedule" not in FLAGS:
        script_flags.define_training_flags(workdir="w", max_steps=10, learning_rate=1.0, warmup_steps=2, log_every=1,
                                           save_every=1)
    model = model_start.create_model("llama", "tiny", {"hidden_size": 32}, families=["llama"])
    tok, workdir = text_data.WordTokenizer(["a"]), str(tmp_path / "w")

    def run(*args):  # a script's start: its schedule, then run.json, then the schedule the Trainer gets
        FLAGS.unparse_flags()
        FLAGS(["prog", f"--workdir={workdir}", "--learning_rate=1.0", "--warmup_steps=2", *args])
        before = script_flags.lr_schedule(1.0, run_record.lr_cycles(workdir))
        run_record.save_run(workdir, "lm", model, tok)
        after = script_flags.lr_schedule(1.0, run_record.lr_cycles(workdir))
        assert [float(before(i)) for i in range(40)] == [float(after(i)) for i in range(40)]
        return after

    def trained(step):  # the run saved a checkpoint at `step`
        os.makedirs(os.path.join(workdir, "checkpoints", str(step)))

    try:
        run("--max_steps=5")  # stopped before its first save (a bad flag refused after run.json, a kill)
        first = run("--max_steps=10")
        assert float(first(10)) == pytest.approx(0.1) and run_record.lr_cycles(workdir) == [[0, 10]]
        trained(10)
        kept = run("--max_steps=20")  # keep: the first run's schedule, its last rate after step 10
        assert [float(kept(i)) for i in range(11)] == [float(first(i)) for i in range(11)]
        assert float(kept(15)) == pytest.approx(0.1) and run_record.lr_cycles(workdir) == [[0, 10]]
        trained(20)
        rewarmed = run("--max_steps=30", "--lr_extension=rewarm")  # a second cycle from the last end, step 20
        assert run_record.lr_cycles(workdir) == [[0, 10], [20, 30]]
        assert float(rewarmed(15)) == pytest.approx(0.1) and float(rewarmed(20)) == 0.0
        assert float(rewarmed(22)) == pytest.approx(1.0) and float(rewarmed(30)) == pytest.approx(0.1)
        trained(30)
        again = run("--max_steps=30")  # the same command re-run: the recorded cycles, no new one
        assert [float(again(i)) for i in range(40)] == [float(rewarmed(i)) for i in range(40)]
        run("--max_steps=25")  # fewer steps than trained: nothing to train, the horizon stays 30
        run("--max_steps=40", "--lr_extension=rewarm")
        assert run_record.lr_cycles(workdir) == [[0, 10], [20, 30], [30, 40]]
        trained(40)
        run("--max_steps=50")  # an extension (keep) that stopped before its first save binds nothing either ...
        run("--max_steps=50", "--lr_extension=rewarm")  # ... so its re-run may rewarm (it had kept the schedule)
        assert run_record.lr_cycles(workdir) == [[0, 10], [20, 30], [30, 40], [40, 50]]
        trained(45)
        run("--max_steps=50")  # saved at 45 under the rewarm: its record binds the re-run
        assert run_record.lr_cycles(workdir) == [[0, 10], [20, 30], [30, 40], [40, 50]]
    finally:
        FLAGS.unparse_flags()


def test_choose_mesh_trains_the_global_batch_on_the_first_layout(capsys):
    """--mesh=auto's glue (train_lm.py's; the ranking itself: tests/test_plan.py): 2 rows per device on 2 devices
    is one global batch of 4, laid out on the layout ranked first (printed) with its rows per data position; a
    budget nothing fits ends in one error naming the least any layout needs."""
    import optax
    from absl import flags

    import engine
    from tests import trainer_task as task

    FLAGS = flags.FLAGS
    script_flags.define_flags()
    abstract = jax.eval_shape(task.init_params)

    def make_trainer(mesh):  # one layout compiles (its rank among others: tests/test_plan.py)
        if mesh.shape["fsdp"] != 2:
            raise ValueError("not in this test")
        return engine.Trainer(mesh=mesh, collate_fn=task.collate_fn, loss_fn=task.loss_fn, params=abstract,
                              optimizer=optax.adam(1e-2))

    example = task.make_examples(1)[0]
    try:
        FLAGS.unparse_flags()
        FLAGS(["prog", "--per_device_batch_size=2"])
        mesh, rows = mesh_choice.choose_mesh(make_trainer, task.collate_fn, example, devices=jax.devices()[:2])
        printed = capsys.readouterr().out
        assert re.search(r"^ +1 +1,2,1 +1 ", printed, re.M) and printed.count("error: not in this test") == 2
        assert (mesh.shape["data"], mesh.shape["fsdp"], mesh.shape["model"]) == (1, 2, 1) and mesh.devices.size == 2
        assert rows == 2 and "3 layouts of 2 devices for 4 rows per step (compiled in " in printed
        assert "--mesh=auto chose 1,2,1: 2 rows per data position" in printed
        with pytest.raises(ValueError, match=r"^--mesh=auto: no layout fits 0\.00 GB per device \(the least, mesh "
                                             r"1,2,1, needs 0\.\d\d GB\); expected a larger budget"):
            mesh_choice.choose_mesh(make_trainer, task.collate_fn, example, memory_gb=1e-6, devices=jax.devices()[:2])
    finally:
        FLAGS.unparse_flags()


def test_parse_flags_helpers():
    assert script_flags.parse_profile_steps([]) is None and script_flags.parse_profile_steps(["2", "5"]) == (2, 5)
    with pytest.raises(ValueError, match=r"--profile_steps=5,2; expected START,END"):
        script_flags.parse_profile_steps(["5", "2"])
    assert script_flags.parse_json("model_overrides", '{"a": 1}') == {"a": 1}
    with pytest.raises(ValueError, match=r"--model_overrides='\[1\]'; expected a JSON object"):
        script_flags.parse_json("model_overrides", "[1]")


def _define_decoder_script_flags():
    """The flags of train_sft.py in this process (each group once: other tests may have defined some)."""
    from absl import flags  # noqa: PLC0415

    FLAGS = flags.FLAGS
    if "lr_schedule" not in FLAGS:
        script_flags.define_training_flags(workdir="w", max_steps=10, learning_rate=1.0, warmup_steps=2, log_every=1,
                                           save_every=1)
    if "init_from" not in FLAGS:
        script_flags.define_decoder_flags(init_from_help="")
    if "toy_size" not in FLAGS:
        script_flags.define_record_flags(what="pairs", fields=("prompt", "response"), toy_size=8)
    return FLAGS


@pytest.mark.parametrize("args", [["--lora_rank=4", "--quantize=int8"], ["--pipeline_stages=2"],
                                  ["hf", "--lora_rank=2"]])
def test_describe_decoder_has_the_model_and_shapes_of_the_real_start(tmp_path, args):
    """--mesh=auto's description of train_sft/dpo/reward's starting point reads no weight, yet holds the very model
    and parameter shapes and dtypes that start_decoder + with_flags build: a fresh model (quantised LoRA; stacked for
    a pipeline) and a Hugging Face directory (its tokenizer too)."""
    import engine  # noqa: PLC0415

    FLAGS = _define_decoder_script_flags()
    if args[0] == "hf":
        model = models.create_model("llama", "tiny", vocab_size=320)
        models.save_pretrained(model, models.init_params(model), str(tmp_path / "hf"))
        args = [f"--init_from={tmp_path / 'hf'}", "--tokenizer=byte", *args[1:]]
    try:
        FLAGS.unparse_flags()
        FLAGS(["prog", *args])
        model, params, tokenizer = mesh_choice.describe_decoder(tasks=("lm",), seq_len=32)
        mesh = engine.make_mesh(data=1, fsdp=2 if FLAGS.pipeline_stages == 1 else 1, stage=FLAGS.pipeline_stages,
                                devices=jax.devices()[:2])
        _, real_model, real_params, real_tokenizer = model_start.start_decoder(mesh, tasks=("lm",), seq_len=32)
        real_model, real_params = model_start.with_flags(real_model, real_params)
        assert model == real_model and type(tokenizer) is type(real_tokenizer)
        assert tokenizer.vocab_size == real_tokenizer.vocab_size
        shapes = lambda tree: jax.tree.map(lambda x: (x.shape, str(x.dtype)), tree)  # noqa: E731
        assert shapes(params) == shapes(real_params)
        assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(params))
    finally:
        FLAGS.unparse_flags()


def test_device_defaults_and_model_overrides_with_init_from(tmp_path, monkeypatch):
    """The scripts' defaults by backend: float32 and plain logits on CPU; on a GPU (the backend faked) bf16 compute,
    scanned layers and the measured loss implementation (plain where plain logits won; a soft-capped model keeps
    them). With --init_from a Hugging Face directory, --model_overrides sets model options (here: scanning off,
    a remat policy, the attention kernel) and refuses architecture fields in one line; a workdir takes runtime
    options only."""
    FLAGS = _define_decoder_script_flags()
    hf = tmp_path / "hf"
    models.save_pretrained(models.create_model("llama", "tiny", vocab_size=320),
                           models.init_params(models.create_model("llama", "tiny", vocab_size=320)), str(hf))
    gemma = models.create_model("gemma2", "tiny")
    try:
        FLAGS.unparse_flags()
        FLAGS(["prog"])
        assert script_flags.compute_dtype() is None and script_flags.loss_implementation() is None
        assert model_start.accelerator_options() == {} and model_start.model_options() == {}
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        choices = {}
        monkeypatch.setattr(script_flags.kernels, "default_implementation",
                            lambda op, **shape: choices.setdefault(op, shape) and "plain")
        assert script_flags.compute_dtype() == jnp.bfloat16 and script_flags.loss_implementation() is None
        kind = jax.devices()[0].device_kind
        assert choices == {"linear_cross_entropy": {"dtype": jnp.bfloat16, "device_kind": kind}}
        monkeypatch.setattr(script_flags.kernels, "default_implementation", lambda op, **shape: "triton")
        assert script_flags.loss_implementation() == "triton" and script_flags.loss_implementation(gemma) is None
        assert model_start.model_options() == {"scan_layers": True}
        FLAGS.unparse_flags()
        FLAGS(["prog", f"--init_from={hf}", "--tokenizer=byte", "--compute_dtype=float32",
               '--model_overrides={"scan_layers": false, "remat": "dots", "attention_implementation": "xla"}'])
        assert script_flags.compute_dtype() is None
        model = model_start.load_hf_model(str(hf), families=["llama"])
        assert (model.config.scan_layers, model.config.remat, model.config.attention_implementation) == (
            False, "dots", "xla")
        _, model, params, _ = model_start.start_decoder(None, tasks=("lm",), seq_len=32)
        assert model.config.remat == "dots" and "layers_0" in params
        FLAGS.unparse_flags()
        FLAGS(["prog", f"--init_from={hf}", '--model_overrides={"hidden_size": 32, "remat": "full"}'])
        with pytest.raises(ValueError, match=r"^--model_overrides sets \['hidden_size'\] with --init_from=.*: the "
                                             r"Hugging Face config.json fixes them; expected only model options of"):
            model_start.load_hf_model(str(hf), families=["llama"])
        FLAGS.unparse_flags()
        FLAGS(["prog", f"--init_from={tmp_path}", '--model_overrides={"scan_layers": true}'])
        with pytest.raises(ValueError, match=r"\['scan_layers'\] with --init_from=.*: a training workdir's run.json "
                                             "fixes them"):
            model_start.model_options(runtime_only=True)
    finally:
        FLAGS.unparse_flags()
