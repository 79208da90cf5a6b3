"""Every script with the families of windows, soft-caps and q / k norms (Qwen3, Mistral, Gemma 2, Gemma 3 text,
Qwen2 with a window) and the mixtures of experts (Mixtral, Qwen3-MoE): from a tiny transformers directory whose
window (4) is shorter than the rows, the chain train_lm.py, SFT -> reward model -> PPO and GRPO -> DPO ->
generate.py -> export_hf.py runs to the end with finite losses; the exported language model is transformers' to
1e-4 on a left-padded batch and generates greedily as ours does, the exported reward model scores as ours does, and
generate.py prints what `models.generate` gives in this process. All slow (CI time): Gemma 2 through SFT,
generate.py and export_hf.py (22 s), and the whole chain of every family (105-195 s each)."""
import math
import re

import jax
import numpy as np
import pytest

import engine
from engine.tasks import lm, run_record, text_data
from engine.tasks.rlhf import preference, reward
from tests.prewarmed import run_scripts
from tests.test_gemma import _CONFIGS as _GEMMA_CONFIGS
from tests.test_mistral import TINY, check_greedy_generate, hf_builder, parity
from tests.test_scripts import ENV, ROOT

# tests/test_qwen.py's, test_mistral.py's and test_gemma.py's tiny models with fewer layers (Gemma 2: one local and
# one global; Gemma 3: two local, one global) and a vocabulary of 320: byte-level tokens for train_lm.py, the toy
# task's 64 words for the rest
_CONFIGS = {name: (config, model, dict(fields, vocab_size=320, num_hidden_layers=layers))
            for (name, (config, model, fields)), layers in zip({
                "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(TINY, head_dim=32)),
                "mistral": ("MistralConfig", "MistralForCausalLM", dict(TINY, sliding_window=4)),
                **_GEMMA_CONFIGS,
                # the window in layer 1 (from max_window_layers on), layer 0 full
                "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(TINY, use_sliding_window=True, sliding_window=4,
                                                                  max_window_layers=1)),
                # the mixtures of experts: 4 experts of 32, top-2 (Mixtral with a window of 4)
                "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                            dict(TINY, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                 sliding_window=4)),
                "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                              dict(TINY, intermediate_size=96, moe_intermediate_size=32, head_dim=32, num_experts=4,
                                   num_experts_per_tok=2, norm_topk_prob=True)),
            }.items(), (2, 2, 2, 3, 2, 2, 2))}
_FAMILY = {"qwen3": "qwen3", "mistral": "mistral", "gemma2": "gemma2", "gemma3": "gemma3_text", "qwen2": "qwen2",
           "mixtral": "mixtral", "qwen3_moe": "qwen3_moe"}
# the toy task's rows (prompt, separator, sorted answer, EOS: 10-16 tokens) on a 4 x 1 x 2 mesh
_TOY = ["--toy_size=64", "--eval_size=8", "--per_device_batch_size=1", "--mesh=-1,1,2", "--log_every=2"]
_ANSWERS = ["--eval_answers=2", "--max_new_tokens=6"]  # SFT's and PPO's greedy answers
_PROMPTS = ["owl cat yak bee", "ram ant"]


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    return hf_builder(tmp_path_factory, _CONFIGS)


def _run_all(*cases):
    """Runs the script cases side by side (tests/prewarmed.py); each must finish. Returns their stdouts."""
    results = run_scripts(cases, ENV, ROOT)
    for case, (code, _, err) in zip(cases, results):
        assert code == 0, f"{case}: {err[-3000:]}"
    return [out for _, out, _ in results]


def _finite_losses(stdout, count):
    """The progress lines' losses: `count` of them, each finite."""
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss (\S+)", stdout, re.M)]
    assert len(losses) == count and all(math.isfinite(x) for x in losses), stdout
    return losses


def _check_generate_and_export(family, hf_model, workdir, generated, exported, greedy=True):
    """generate.py's answers (printed on a 2x2x2 mesh) are `models.generate`'s here on one device; transformers reads
    the exported directory to our logits (within 1e-4, left-padded) and (greedy) generates greedily as we do."""
    transformers = pytest.importorskip("transformers")
    task, model, params, tokenizer = run_record.restore_run(str(workdir), engine.make_mesh(devices=jax.devices()[:1]))
    assert run_record.family_of(model) == _FAMILY[family]
    printed = dict(re.findall(r"^--- '(.*)':\n(.*)$", generated, re.M))
    ours = lm.generate_texts(model, params, tokenizer, _PROMPTS, max_new_tokens=6,
                             after_prompt=(preference.separator(tokenizer),))
    assert printed == dict(zip(_PROMPTS, ours)), generated
    params = jax.device_get(params)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    assert type(theirs) is type(hf_model)
    assert parity(theirs, model, params) <= 1e-4
    if greedy:
        check_greedy_generate(theirs, model, params)


@pytest.mark.slow  # CI time (22 s); Gemma 2 itself: tests/test_gemma.py, the scripts: the chains below
def test_gemma2_sft_generate_and_export(hf_checkpoint, tmp_path):
    """The default suite's chain: SFT from a transformers Gemma 2 directory, then generate.py and export_hf.py of the
    SFT workdir side by side, and generate.py on the export."""
    hf_model, path = hf_checkpoint("gemma2")
    sft = tmp_path / "sft"
    out, = _run_all(("train_sft.py", f"--init_from={path}", "--tokenizer=word", f"--workdir={sft}", "--max_steps=2",
                     "--seq_len=24", "--eval_answers=0", *_TOY))
    _finite_losses(out, 1)
    generated, _ = _run_all(
        ("generate.py", f"--workdir={sft}", f"--prompts={','.join(_PROMPTS)}", "--max_new_tokens=6", "--mesh=2,2,2"),
        ("export_hf.py", f"--workdir={sft}", f"--out={tmp_path / 'hf'}"))
    _check_generate_and_export("gemma2", hf_model, sft, generated, tmp_path / "hf", greedy=False)
    # The export records its SFT run: generate.py answers from it after the separator, as from the workdir.
    exported, = _run_all(("generate.py", f"--init_from={tmp_path / 'hf'}", "--tokenizer=word",
                          f"--prompts={','.join(_PROMPTS)}", "--max_new_tokens=6", "--mesh=2,2,2"))
    assert exported.split("--- ")[1:] == generated.split("--- ")[1:], (exported, generated)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(_CONFIGS))
def test_every_script_runs_the_family(hf_checkpoint, tmp_path, family):
    """train_lm.py (byte-level tokens) and SFT from the transformers directory; a reward model, DPO and GRPO (the
    toy rule reward) from SFT; PPO against that reward model, generate.py on DPO, and export_hf.py of DPO and of
    the reward model."""
    transformers = pytest.importorskip("transformers")
    import torch

    hf_model, path = hf_checkpoint(family)
    w = {name: tmp_path / name for name in ("lm", "sft", "rm", "dpo", "grpo", "ppo", "dpo_hf", "rm_hf")}
    (tmp_path / "a.txt").write_text("".join(text_data.default_corpus(max_bytes=4_000)))
    lm_out, sft_out = _run_all(
        ("train_lm.py", f"--init_from={path}", "--tokenizer=byte", f"--data={tmp_path / 'a.txt'}",
         f"--workdir={w['lm']}", "--max_steps=2", "--log_every=1", "--seq_len=32", "--per_device_batch_size=1",
         "--mesh=2,2,2", "--prompts="),
        ("train_sft.py", f"--init_from={path}", "--tokenizer=word", f"--workdir={w['sft']}", "--max_steps=4",
         "--seq_len=24", *_TOY, *_ANSWERS))
    _finite_losses(lm_out, 2)
    _finite_losses(sft_out, 2)
    rm_out, dpo_out, grpo_out = _run_all(
        ("train_reward.py", f"--init_from={w['sft']}", f"--workdir={w['rm']}", "--max_steps=4", "--seq_len=24",
         *_TOY),
        ("train_dpo.py", f"--init_from={w['sft']}", f"--workdir={w['dpo']}", "--max_steps=4", "--seq_len=24", *_TOY),
        ("train_ppo.py", f"--init_from={w['sft']}", f"--workdir={w['grpo']}", "--advantage_estimator=grpo",
         "--samples_per_prompt=2", "--rollout_batch_size=8", "--max_steps=2", *_TOY, *_ANSWERS))
    _finite_losses(rm_out, 2)
    _finite_losses(dpo_out, 2)
    _finite_losses(grpo_out, 1)
    ppo_out, generated, *_ = _run_all(
        ("train_ppo.py", f"--init_from={w['sft']}", f"--reward_from={w['rm']}", f"--workdir={w['ppo']}",
         "--rollout_batch_size=8", "--max_steps=2", *_TOY, *_ANSWERS),
        ("generate.py", f"--workdir={w['dpo']}", f"--prompts={','.join(_PROMPTS)}", "--max_new_tokens=6",
         "--mesh=2,2,2"),
        ("export_hf.py", f"--workdir={w['dpo']}", f"--out={w['dpo_hf']}"),
        ("export_hf.py", f"--workdir={w['rm']}", f"--out={w['rm_hf']}"))
    _finite_losses(ppo_out, 1)
    for out in (grpo_out, ppo_out):
        rewards = re.findall(r"^iteration +1 +step +2 +reward (\S+) +kl (\S+)", out, re.M)
        assert rewards and all(math.isfinite(float(x)) for x in rewards[0]), out
    _check_generate_and_export(family, hf_model, w["dpo"], generated, w["dpo_hf"])

    # The exported reward model (transformers' *ForSequenceClassification) scores whole right-padded rows as ours.
    _, model, params, tokenizer = run_record.restore_run(str(w["rm"]), engine.make_mesh(devices=jax.devices()[:1]))
    triples = preference.toy_preferences(2, seed=3)
    examples, _ = preference.encode_preferences(triples, tokenizer, seq_len=24)
    ours = np.asarray(reward.sequence_rewards(model, params, preference.collate_preferences(examples)))
    rows = [tokenizer.encode(t["prompt"]) + [preference.separator(tokenizer)] + tokenizer.encode(t[key]) +
            [tokenizer.eos_id] for t in triples for key in ("chosen", "rejected")]
    ids = np.zeros((len(rows), 24), np.int64)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = row
    classifier = transformers.AutoModelForSequenceClassification.from_pretrained(str(w["rm_hf"])).eval()
    with torch.no_grad():
        theirs = classifier(torch.tensor(ids)).logits[:, 0].numpy()
    np.testing.assert_allclose(ours.reshape(-1), theirs, atol=1e-4)
