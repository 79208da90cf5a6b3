"""The scripts end to end in subprocesses with tiny settings: outputs exist (TensorBoard events, profiler trace,
checkpoints, run.json, generations), the loss falls, a second invocation resumes, generate.py reads what the training
scripts wrote, and bad flags end with one `error:` line and exit code 2, never a traceback."""
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import engine
import models
from engine.tasks import run_record, script_flags, seq2seq, text_data
from engine.tasks.rlhf import preference
from tests.prewarmed import run_scripts
from tests.xla_flags import cpu_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, XLA_FLAGS=cpu_devices(8), JAX_PLATFORMS="cpu")


def _run(script, *args, ok=True, env=ENV):
    out = subprocess.run([sys.executable, f"scripts/{script}", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    if ok:
        assert out.returncode == 0, out.stderr[-3000:]
    return out


def _losses(stdout):
    return [float(x) for x in re.findall(r"^step +\d+ +loss ([0-9.]+)", stdout, re.M)]


def _eval_losses(stdout):
    after, before = re.search(r"eval loss after training: ([0-9.]+) \(was ([0-9.]+)\)", stdout).groups()
    return float(before), float(after)


def _files(path):
    return [f for _, _, fs in os.walk(path) for f in fs]


def _steps(workdir):
    return sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")) if s.isdigit())


TINY_LM = ["--seq_len=32", "--per_device_batch_size=2", "--max_new_tokens=4", "--log_every=3", "--save_every=3",
           '--model_overrides={"hidden_size": 32, "intermediate_size": 64}']  # last: a fresh model's (not --init_from's)


def _tiny_hf(family, path):
    model = models.create_model(family, "tiny", vocab_size=320)  # byte-level tokens need 320
    models.save_pretrained(model, models.init_params(model, jax.random.PRNGKey(0)), str(path))


def _stdlib_txt(path):
    path.parent.mkdir(exist_ok=True)
    path.write_text("".join(text_data.default_corpus(max_bytes=12_000)))
    return path


def test_scripts_offer_every_decoder_family():
    """The scripts' --model and --init_from take every decoder family the registry has (MoE ones included)."""
    decoders = {name for name, family in models.FAMILIES.items() if issubclass(family.Model, models.layers.DecoderLM)}
    assert set(script_flags.DECODER_FAMILIES) == decoders


def test_train_lm_fine_tunes_resumes_and_generate_reads_workdir_and_hf_dir(tmp_path):
    """The main job from a Hugging Face directory (made by models.save_pretrained): loss falls, TensorBoard, trace,
    checkpoints, run.json, evals every 3 steps keeping the best one's state; the same command resumes (here with the
    fused loss: same parameters, no logits, under the model axis); generate.py reads the workdir's best checkpoint
    and the Hugging Face directory on other meshes."""
    _tiny_hf("llama", tmp_path / "hf")
    workdir = tmp_path / "work"
    args = [f"--init_from={tmp_path / 'hf'}", "--tokenizer=byte", f"--data={_stdlib_txt(tmp_path / 'data' / 'a.txt').parent}/*.txt",
            f"--workdir={workdir}", "--mesh=-1,1,2", "--learning_rate=1e-2", "--warmup_steps=2", *TINY_LM[:-1],
            "--eval_every=3", "--save_best=loss:min"]
    out = _run("train_lm.py", "--max_steps=6", "--profile_steps=2,4", *args)
    before, after = _eval_losses(out.stdout)
    assert after < 0.95 * before and "--- sample for 'def '" in out.stdout
    assert any(f.startswith("events.out.tfevents") for f in _files(workdir / "tensorboard"))
    assert any(f.endswith(".xplane.pb") for f in _files(workdir / "tensorboard"))  # the profiler trace
    assert _steps(workdir)[-1] == 6
    run = json.loads((workdir / "run.json").read_text())
    assert run["task"] == "lm" and run["family"] == "llama" and run["tokenizer"] == {"kind": "byte"}

    again = _run("train_lm.py", "--max_steps=9", "--prompts=", "--loss_implementation=xla", *args,
                 "--learning_rate=5e-3")
    assert "resumed from" in again.stdout and "at step 9" in again.stdout and _steps(workdir)[-1] == 9
    assert f"--learning_rate=0.005 where the run in {workdir} had 0.01" in again.stderr, again.stderr
    assert _eval_losses(again.stdout)[1] < after
    evals = re.findall(r"^eval at step (\d+): loss ([0-9.]+)$", out.stdout + again.stdout, re.M)
    assert [int(s) for s, _ in evals] == [3, 6, 9], out.stdout + again.stdout
    best_step, best_loss = min(evals, key=lambda e: float(e[1]))
    assert f"best eval loss {best_loss} at step {best_step}" in again.stdout
    assert os.listdir(workdir / "best") == [best_step]

    gen = _run("generate.py", f"--workdir={workdir}", "--checkpoint=best", "--prompts=def,class", "--max_new_tokens=5",
               "--mesh=2,2,2")
    assert re.findall(r"^--- '(\w+)':$", gen.stdout, re.M) == ["def", "class"]
    assert f"restored step {best_step} of {workdir} (best checkpoint)" in gen.stderr
    gen = _run("generate.py", f"--init_from={tmp_path / 'hf'}", "--tokenizer=byte", "--prompts=the", "--max_new_tokens=3",
               "--mesh=1,1,-1")
    assert "--- 'the':" in gen.stdout


def _auto_mesh(workdir, devices, *args, ok=True, script="train_lm.py"):
    """`script` --mesh=auto on `devices` devices: (the process, the table's rows as (mesh, sent MB, fits), the
    choice)."""
    tiny = [*TINY_LM, "--prompts=", "--log_every=1"] if script == "train_lm.py" else []
    out = subprocess.run([sys.executable, f"scripts/{script}", f"--workdir={workdir}", "--mesh=auto", *tiny, *args],
                         cwd=ROOT, capture_output=True, text=True, env={**ENV, "XLA_FLAGS": cpu_devices(devices)},
                         timeout=300)
    assert (out.returncode == 0) == ok, out.stderr[-3000:]
    return (out, *_ranking(out.stdout))


def _ranking(stdout):
    """--mesh=auto's printed table as rows (mesh, MB sent (across hosts where that column is printed: it ranks
    first), fits), and the match of its choice line."""
    rows = re.findall(r"^ +\d+ +(\d,\d,\d) +\d+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +([\d.]+)(?: +[\d.]+){5}"
                      r"(?: +([\d.]+))? +(True|False)$", stdout, re.M)
    chosen = re.search(r"^--mesh=auto chose (\d,\d,\d): (\d+) rows per data position$", stdout, re.M)
    return [(m, float(across or sent), fits == "True") for m, sent, across, fits in rows], chosen


@pytest.mark.slow
def test_train_lm_chooses_its_mesh(tmp_path):
    """--mesh=auto compiles the run's step on every layout of the 2 devices for the global batch of 2 rows per
    device (4), prints the ranking and trains on its first: the least communication, its rows per data position
    making up the same 4 rows."""
    out, rows, chosen = _auto_mesh(tmp_path / "w", 2, "--max_steps=1")
    _check_choice(out, rows, chosen, layouts=3, global_batch=4)
    assert _steps(tmp_path / "w")[-1] == 1


def _check_choice(out, rows, chosen, layouts, global_batch, stages=1):
    assert len(rows) == layouts and all(fits for *_, fits in rows), out.stdout
    sent = [s for _, s, _ in rows]
    assert sent == sorted(sent) and chosen.group(1) == rows[0][0], out.stdout
    data, fsdp, model = map(int, chosen.group(1).split(","))
    assert int(chosen.group(2)) * data * fsdp == global_batch
    layout = f"on mesh data={data} x fsdp={fsdp} x expert=1 x context=1 x stage={stages} x model={model}"
    assert layout in out.stdout + out.stderr


@pytest.mark.slow
def test_train_lm_auto_mesh_resumes_and_refuses_a_budget_nothing_fits(tmp_path):
    """On 4 devices (6 layouts, 8 rows): the same choice again on resuming; a budget no layout fits ends in one
    line naming the least any needs, before a workdir file is written."""
    first, rows, chosen = _auto_mesh(tmp_path / "w", 4, "--max_steps=2")
    _check_choice(first, rows, chosen, layouts=6, global_batch=8)
    again, _, chosen_again = _auto_mesh(tmp_path / "w", 4, "--max_steps=3")
    assert "resumed from" in again.stdout and chosen_again.groups() == chosen.groups()
    assert _steps(tmp_path / "w")[-1] == 3
    failed, rows, _ = _auto_mesh(tmp_path / "x", 4, "--mesh_memory_gb=0.0001", ok=False)
    assert len(rows) == 6 and not any(fits for *_, fits in rows)
    assert failed.returncode == 2 and re.search(r"^error: --mesh=auto: no layout fits 0\.00 GB per device \(the "
                                                r"least, mesh \d,\d,\d, needs 0\.\d+ GB\); expected",
                                                failed.stderr.splitlines()[-1]), failed.stderr[-2000:]
    assert not os.path.exists(tmp_path / "x" / "run.json")


@pytest.mark.slow
def test_train_lm_auto_mesh_across_two_processes(tmp_path):
    """2 processes x 2 devices: both rank the 6 layouts of the 4 devices (by the bytes sent between the processes
    first), take process 0's first (broadcast) and train on it as one run: the same losses on both. The first
    keeps its model axis within a process."""
    from tests.test_distributed import _free_port  # noqa: PLC0415

    args = [sys.executable, "scripts/train_lm.py", "--mesh=auto", f"--workdir={tmp_path / 'w'}", *TINY_LM,
            "--prompts=", "--max_steps=2", "--log_every=1", "--per_device_batch_size=1",
            f"--coordinator_address=localhost:{_free_port()}", "--num_processes=2"]
    procs = [subprocess.Popen([*args, f"--process_id={i}"], cwd=ROOT, env={**ENV, "XLA_FLAGS": cpu_devices(2)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert "x-host MB" in outs[0][0]
    rows, chosen = _ranking(outs[0][0])
    _check_choice(subprocess.CompletedProcess(args, 0, *outs[0]), rows, chosen, layouts=6, global_batch=4)
    assert chosen.group(1) in ("2,1,2", "2,2,1"), outs[0][0]  # data (or fsdp) alone spans the processes
    losses = [re.findall(r"^step +\d+ +loss ([\d.]+)", out, re.M) for out, _ in outs]
    assert len(losses[0]) == 2 and losses[0] == losses[1], losses


@pytest.mark.slow
def test_fine_tuning_scripts_choose_their_mesh(tmp_path):
    """--mesh=auto in the fine-tuning scripts, each on 4 devices from its own kind of start (described without
    reading a weight): SFT of a fresh model with LoRA adapters, DPO from that workdir (adapters merged), a reward
    model whose backbone is a 2-stage pipeline (3 layouts of the 2 positions), T5 with LoRA on packed pairs. Each
    trains on the layout it ranked first, for the global batch of --per_device_batch_size rows per device."""
    toy = ["--toy_size=64", "--eval_size=16", "--log_every=2", "--seq_len=24"]
    sft = tmp_path / "sft"
    out, rows, chosen = _auto_mesh(sft, 4, "--max_steps=2", "--eval_answers=2", "--max_new_tokens=4",
                                   "--lora_rank=2", "--per_device_batch_size=2", *toy, script="train_sft.py")
    _check_choice(out, rows, chosen, layouts=6, global_batch=8)
    assert _steps(sft)[-1] == 2
    out, rows, chosen = _auto_mesh(tmp_path / "dpo", 4, f"--init_from={sft}", "--max_steps=1",
                                   "--per_device_batch_size=2", *toy, script="train_dpo.py")
    _check_choice(out, rows, chosen, layouts=6, global_batch=8)
    out, rows, chosen = _auto_mesh(tmp_path / "rm", 4, "--max_steps=1", "--pipeline_stages=2",
                                   "--per_device_batch_size=1", *toy, script="train_reward.py")
    _check_choice(out, rows, chosen, layouts=3, global_batch=2, stages=2)
    out, rows, chosen = _auto_mesh(tmp_path / "t5", 4, "--max_steps=1", "--per_device_batch_size=1", "--lora_rank=2",
                                   "--pack_pairs", "--max_input_len=16", "--max_target_len=16", *toy[:3],
                                   script="finetune_seq2seq.py")
    _check_choice(out, rows, chosen, layouts=6, global_batch=4)


@pytest.mark.slow
def test_train_lm_restarted_on_fewer_devices_keeps_the_global_batch_and_trains_like_the_uninterrupted_run(tmp_path):
    """An elastic restart: 3 steps on 8 devices (global batch 16), then the same command on 4 devices: the run.json
    global batch makes --accumulate_grad_batches 2, the rows held out for eval are the same, the data position is the
    same batch, and steps 4-6 end where the 8-device run's do (to float32's reduction-order rounding); 3 devices
    cannot make 16 and are refused."""
    data = _stdlib_txt(tmp_path / "data" / "small.txt")  # 12 kB: 2% of its rows is less than a micro-batch

    def run(devices, workdir, *args, ok=True):
        env = dict(ENV, XLA_FLAGS=cpu_devices(devices))
        return subprocess.run([sys.executable, "scripts/train_lm.py", f"--workdir={workdir}", "--prompts=",
                               f"--data={data}", f"--mesh={devices},1,1", *TINY_LM, "--log_every=1", *args], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300, check=ok)

    whole = run(8, tmp_path / "whole", "--max_steps=6")
    run(8, tmp_path / "elastic", "--max_steps=3")
    elastic = run(4, tmp_path / "elastic", "--max_steps=6")
    assert "--accumulate_grad_batches=2 keeps it" in elastic.stderr + elastic.stdout
    split = lambda out: re.findall(r"(\d+) train rows and (\d+) eval rows", out.stderr + out.stdout)  # noqa: E731
    assert split(elastic) == split(whole) == [split(whole)[0]], split(elastic)  # its micro-batch halved, not its eval
    assert _steps(tmp_path / "elastic")[-1] == 6
    np.testing.assert_allclose(_losses(elastic.stdout)[-3:], _losses(whole.stdout)[-3:], rtol=1e-4)
    np.testing.assert_allclose(_eval_losses(elastic.stdout)[1], _eval_losses(whole.stdout)[1], rtol=1e-4)
    refused = run(3, tmp_path / "elastic", "--max_steps=9", ok=False)
    assert refused.returncode == 2 and "global batch of 16 examples, which 6 rows a step" in refused.stderr, (
        refused.stderr[-2000:])


@pytest.mark.slow
def test_train_lm_writes_local_checkpoints_beside_the_workdirs_and_refuses_a_bad_interval(tmp_path):
    """--local_checkpoint_dir / --local_save_every reach engine.Checkpointing: the local tier holds the newest even
    step, the workdir the --save_every ones; a run interrupted between them restores the local one
    (tests/test_checkpoint_tiers.py). A bad interval or replica count is refused in one line."""
    args = [f"--workdir={tmp_path / 'w'}", "--prompts=", *TINY_LM, f"--local_checkpoint_dir={tmp_path / 'local'}",
            "--local_save_every=2", "--save_every=100"]
    _run("train_lm.py", *args, "--max_steps=5")
    (run,) = os.listdir(tmp_path / "local")
    assert os.listdir(tmp_path / "local" / run / "process_0") == ["4"] and _steps(tmp_path / "w") == [5]
    refused = _run("train_lm.py", *args, "--local_save_every=0", ok=False)
    assert refused.returncode == 2 and "--local_save_every=0; expected an integer >= 1" in refused.stderr
    refused = _run("train_lm.py", *args, "--local_replicas=2", ok=False)
    assert refused.returncode == 2 and "local_replicas" in refused.stderr and "2" in refused.stderr
    assert len([line for line in refused.stderr.splitlines() if line.startswith("error:")]) == 1


@pytest.mark.slow
def test_train_lm_on_a_weighted_mixture_of_parquet_and_jsonl_resumes(tmp_path):
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    text = open(_stdlib_txt(tmp_path / "a.txt")).read()
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"body": [text[i:i + 500] for i in range(0, 6000, 500)]}), tmp_path / "data" / "a.parquet")
    with open(tmp_path / "data" / "b.jsonl", "w") as f:
        for i in range(6000, 12000, 500):
            f.write(json.dumps({"body": text[i:i + 500]}) + "\n")
    args = [f"--data={tmp_path / 'data' / 'a.parquet'}:3,{tmp_path / 'data' / 'b.jsonl'}:1", "--text_column=body",
            f"--workdir={tmp_path / 'work'}", *TINY_LM, "--prompts="]
    out = _run("train_lm.py", "--max_steps=3", *args)
    assert "eval loss after training" in out.stdout, out.stdout
    again = _run("train_lm.py", "--max_steps=6", *args)
    assert "resumed from" in again.stdout and _steps(tmp_path / "work")[-1] == 6
    # the stream is set to the checkpoint's iterator state: the 3 trained batches of 16 are not read again
    assert "resuming MixtureIterator at example 48 by set_state" in (tmp_path / "work" / "log.txt").read_text()
    shares = re.search(r"data mixture shares of (\d+) windows: .*a.parquet ([0-9.]+) \(weight 0.7500\), "
                       r".*b.jsonl ([0-9.]+) \(weight 0.2500\)", again.stderr)
    assert shares and int(shares[1]) == 256 + 6 * 16 and abs(float(shares[2]) - 0.75) < 0.01, again.stderr[-2000:]
    longer = _run("train_lm.py", "--max_steps=9", *args, "--seq_len=48", ok=False)  # its eval windows would differ
    assert longer.returncode == 2 and "eval loss" not in longer.stdout, longer.stdout[-2000:]
    assert longer.stderr.splitlines()[-1].endswith(
        f"(--seq_len=48) is not the data the run in {tmp_path / 'work'} trained on (then the mixture's first 256 "
        "windows of 33 tokens, now the mixture's first 256 windows of 49 tokens): its eval rows and the epoch's order "
        "would change; expected the same files and --seq_len to resume it, --data_change=continue to train on from "
        "step 6 on this data (eval rows drawn again), or another --workdir"), longer.stderr[-2000:]
    other = _run("train_lm.py", "--max_steps=9", *[a.replace(":3,", ":2,") for a in args], ok=False)
    assert other.returncode == 2 and "eval loss" not in other.stdout, other.stdout[-2000:]
    assert "data: the state is a position of the mixture" in other.stderr.splitlines()[-1], other.stderr[-2000:]
    bad = _run("train_lm.py", f"--data={tmp_path / 'data' / 'a.parquet'}:x", ok=False)
    assert bad.returncode == 2 and "has no positive weight" in bad.stderr.splitlines()[-1], bad.stderr[-2000:]


@pytest.mark.slow
def test_prepare_data_then_train_lm_reads_the_tokens_through_a_memory_map(tmp_path):
    txt = _stdlib_txt(tmp_path / "data" / "a.txt")
    out = _run("prepare_data.py", f"--data={txt}", f"--out={tmp_path / 'tokens'}")
    assert re.search(r"^1 documents -> 12001 tokens \(uint16, largest id 258\) in ", out.stdout, re.M), out.stdout
    args = [f"--data={tmp_path / 'tokens'}", f"--workdir={tmp_path / 'work'}", "--learning_rate=1e-2",
            "--warmup_steps=2", *TINY_LM, "--prompts="]
    out = _run("train_lm.py", "--max_steps=6", *args)
    before, after = _eval_losses(out.stdout)
    assert after < 0.95 * before
    again = _run("train_lm.py", "--max_steps=9", *args)  # resumes mid-epoch in the same shuffled windows
    assert "resumed from" in again.stdout and _steps(tmp_path / "work")[-1] == 9
    for bad, message in [((f"--data={txt}", f"--out={tmp_path / 'tokens'}"), "already holds tokens"),
                         ((f"--data={txt}", "--out="), "--out is empty"),
                         ((f"--data={txt}", f"--out={tmp_path / 'x'}", f"--tokenizer={tmp_path}"),
                          "has neither tokenizer.json nor tokenizer.model")]:
        failed = _run("prepare_data.py", *bad, ok=False)
        assert failed.returncode == 2 and message in failed.stderr.splitlines()[-1], failed.stderr[-2000:]


@pytest.mark.slow
def test_train_lm_on_a_pipeline_trains_like_without_and_generate_reads_it(tmp_path):
    data = f"--data={_stdlib_txt(tmp_path / 'data' / 'a.txt')}"
    common = [data, *TINY_LM, "--max_steps=6", "--log_every=2", "--prompts="]
    # The same global batch of 8 rows: 4 data positions x 2, or 2 stages x 2 data positions x 4 rows.
    flat = _run("train_lm.py", *common, f"--workdir={tmp_path / 'flat'}", "--mesh=4,1,2", "--per_device_batch_size=2")
    piped = _run("train_lm.py", *common, f"--workdir={tmp_path / 'pipe'}", "--mesh=2,1,2", "--per_device_batch_size=4",
                 "--pipeline_stages=2", "--pipeline_microbatches=2")
    assert "on mesh data=2 x fsdp=1 x expert=1 x context=1 x stage=2 x model=2" in piped.stdout + piped.stderr
    np.testing.assert_allclose(_losses(piped.stdout), _losses(flat.stdout), rtol=1e-3)
    np.testing.assert_allclose(_eval_losses(piped.stdout), _eval_losses(flat.stdout), rtol=1e-3)
    assert json.loads((tmp_path / "pipe" / "run.json").read_text())["config"]["scan_layers"] is True
    gen = _run("generate.py", f"--workdir={tmp_path / 'pipe'}", "--prompts=def ", "--max_new_tokens=3",
               "--pipeline_stages=2", "--mesh=2,1,2")
    assert "--- 'def':" in gen.stdout
    again = _run("train_lm.py", f"--workdir={tmp_path / 'pipe'}", "--mesh=4,1,2", *common, ok=False)
    assert again.returncode == 2 and "fields ['scan_layers'] differ" in again.stderr
    assert again.stderr.strip().endswith('its layers were scanned (stacked), so --model_overrides with "scan_layers": '
                                         "true (GPU and TPU runs default to true, CPU runs to false), and "
                                         "--pipeline_stages > 1 if it ran as a pipeline")


@pytest.mark.slow
def test_train_lm_on_an_interleaved_pipeline_records_its_stored_stack(tmp_path):
    """--pipeline_virtual_stages=2 trains like the flat mesh; run.json records it (the stack is stored [V, L / V]),
    so a resume under another value is refused in one line and one under the same value continues; its export starts
    a GPipe run, and generate.py reads the workdir on a mesh without stages."""
    data = f"--data={_stdlib_txt(tmp_path / 'data' / 'a.txt')}"
    four = '--model_overrides={"hidden_size": 32, "intermediate_size": 64, "num_layers": 4}'
    common = [data, *TINY_LM[:-1], four, "--max_steps=4", "--log_every=2", "--prompts="]
    flat = _run("train_lm.py", *common, f"--workdir={tmp_path / 'flat'}", "--mesh=4,1,2", "--per_device_batch_size=2")
    piped = [*common, "--mesh=2,1,2", "--per_device_batch_size=4", "--pipeline_stages=2", "--pipeline_microbatches=2"]
    inter = _run("train_lm.py", *piped, f"--workdir={tmp_path / 'v2'}", "--pipeline_virtual_stages=2")
    np.testing.assert_allclose(_losses(inter.stdout), _losses(flat.stdout), rtol=1e-3)
    assert json.loads((tmp_path / "v2" / "run.json").read_text())["config"]["pipeline_virtual_stages"] == 2
    again = _run("train_lm.py", *piped, f"--workdir={tmp_path / 'v2'}", "--max_steps=6", ok=False)
    assert again.returncode == 2 and "fields ['pipeline_virtual_stages'] differ" in again.stderr
    resumed = _run("train_lm.py", *piped, f"--workdir={tmp_path / 'v2'}", "--pipeline_virtual_stages=2",
                   "--max_steps=6")
    assert "restored" in resumed.stdout + resumed.stderr and _losses(resumed.stdout), resumed.stderr[-2000:]
    assert again.stderr.strip().endswith("its layers are stored for --pipeline_virtual_stages=2 (its export_hf.py "
                                         "directory, or the workdir as --init_from of the scripts that take one, "
                                         "starts a run under another value)")
    _run("export_hf.py", f"--workdir={tmp_path / 'v2'}", f"--out={tmp_path / 'hf'}")
    _run("train_lm.py", f"--init_from={tmp_path / 'hf'}", "--tokenizer=byte",
         *[a for a in piped if a != four], f"--workdir={tmp_path / 'v1'}", "--max_steps=2")
    assert json.loads((tmp_path / "v1" / "run.json").read_text())["config"]["pipeline_virtual_stages"] == 1
    gen = _run("generate.py", f"--workdir={tmp_path / 'v2'}", "--prompts=def ", "--max_new_tokens=3", "--mesh=4,1,2")
    assert "--- 'def':" in gen.stdout


@pytest.mark.slow
def test_train_lm_on_a_context_mesh_trains_alike_with_either_step(tmp_path):
    """--context_parallel=2 on data 2 x model 2: --train_step=shard_map (context manual in the step) logs the
    losses of the jit step, and the runs say which step ran."""
    common = [f"--data={_stdlib_txt(tmp_path / 'data' / 'a.txt')}", *TINY_LM, "--max_steps=6", "--log_every=2",
              "--prompts=", "--mesh=2,1,2", "--context_parallel=2"]
    runs = {step: _run("train_lm.py", *common, f"--workdir={tmp_path / step}", f"--train_step={step}")
            for step in ("jit", "shard_map")}
    np.testing.assert_allclose(_losses(runs["shard_map"].stdout), _losses(runs["jit"].stdout), rtol=1e-5)
    assert len(_losses(runs["jit"].stdout)) == 3
    for step, out in runs.items():
        assert f"step={step}" in out.stdout + out.stderr, step


@pytest.mark.slow
def test_ppo_and_dpo_on_a_pipeline_equal_ppo_and_dpo_without(tmp_path):
    """SFT -> reward model -> PPO, PPO's actor and critic each a 2-stage pipeline (stage 2 x data 2 x model 2, the
    SFT and reward workdirs unscanned: their layers are stacked on load): the rollouts' reward, the loss and the
    greedy answers' reward equal PPO's on data 4 x model 2 with the same global batch; DPO's losses likewise."""
    sft, rm = tmp_path / "sft", tmp_path / "rm"
    toy = ["--toy_size=64", "--eval_size=16", "--log_every=2"]
    _run("train_sft.py", f"--workdir={sft}", "--max_steps=4", "--seq_len=24", "--eval_answers=2",
         "--max_new_tokens=4", "--mesh=-1,1,2", "--per_device_batch_size=1", *toy)
    _run("train_reward.py", f"--init_from={sft}", f"--workdir={rm}", "--max_steps=4", "--seq_len=24",
         "--mesh=-1,1,2", "--per_device_batch_size=1", *toy)
    ppo = [f"--init_from={sft}", f"--reward_from={rm}", "--rollout_batch_size=8", "--max_new_tokens=6",
           "--eval_answers=4", "--max_steps=2", "--mesh=-1,1,2", *toy]
    flat = _run("train_ppo.py", *ppo, f"--workdir={tmp_path / 'flat'}", "--per_device_batch_size=1")
    piped = _run("train_ppo.py", *ppo, f"--workdir={tmp_path / 'piped'}", "--per_device_batch_size=2",
                 "--pipeline_stages=2")
    lines = lambda out: re.findall(r"^(iteration .*|step .*loss.*|after training.*)$", out.stdout, re.M)  # noqa
    assert len(lines(flat)) == 3 and lines(piped) == lines(flat), (lines(piped), lines(flat))
    run = json.loads((tmp_path / "piped" / "run.json").read_text())
    assert run["config"]["scan_layers"] and run["critic"]["config"]["scan_layers"]
    # DPO likewise (its reference log-probabilities come from the pipelined Predictor pass).
    dpo = [f"--init_from={sft}", "--max_steps=2", "--seq_len=24", "--mesh=-1,1,2", *toy]
    flat = _run("train_dpo.py", *dpo, f"--workdir={tmp_path / 'dpo_flat'}", "--per_device_batch_size=1")
    piped = _run("train_dpo.py", *dpo, f"--workdir={tmp_path / 'dpo_piped'}", "--per_device_batch_size=2",
                 "--pipeline_stages=2")
    lines = lambda out: re.findall(r"^(step .*loss.*|eval DPO loss.*)$", out.stdout, re.M)  # noqa: E731
    assert len(lines(flat)) == 3 and lines(piped) == lines(flat), (lines(piped), lines(flat))


@pytest.mark.slow
def test_train_lm_from_scratch_resumes_then_sft_then_dpo(tmp_path):
    # With streaming DiLoCo over the data axis (4 replicas, three parts taking an outer step in turn each step, int4
    # outer gradients, overlapped).
    tiny = [f"--workdir={tmp_path}", f"--data={_stdlib_txt(tmp_path / 'data' / 'a.txt')}", "--mesh=-1,1,2",
            "--diloco_inner_steps=3", "--diloco_fragments=3", "--diloco_outer_dtype=int4", "--diloco_overlap",
            *TINY_LM]
    out = _run("train_lm.py", "--max_steps=6", *tiny)
    before, after = _eval_losses(out.stdout)
    assert after < before and _steps(tmp_path)[-1] == 6
    # The model FLOP/s from models.train_flops_per_example; no MFU on CPU.
    assert re.search(r"^throughput of the last logged steps: [0-9.]+ s/step, [0-9.]+ examples/s, [0-9.e+-]+ model "
                     r"TFLOP/s per device$", out.stdout, re.M), out.stdout
    again = _run("train_lm.py", "--max_steps=9", "--prompts=", *tiny)
    assert "resumed from" in again.stdout and "at step 9" in again.stdout and _steps(tmp_path)[-1] == 9

    # SFT -> DPO: the toy task from this (DiLoCo-trained) workdir, whose parameters alone are taken; DPO's reference
    # is the SFT checkpoint, frozen. Then generate.py reads the DPO workdir.
    sft, dpo = tmp_path / "sft", tmp_path / "dpo"
    toy = ["--toy_size=64", "--eval_size=16", "--per_device_batch_size=1", "--mesh=-1,1,2", "--seq_len=48"]
    out = _run("train_sft.py", f"--init_from={tmp_path}", f"--workdir={sft}", "--max_steps=4", "--log_every=2",
               "--eval_answers=4", "--max_new_tokens=4", *toy)
    loss = re.search(r"eval response loss after training: ([0-9.]+) \(was ([0-9.]+)\), exact match", out.stdout)
    assert loss and float(loss[1]) < float(loss[2]), out.stdout
    assert json.loads((sft / "run.json").read_text())["task"] == "sft" and _steps(sft)[-1] == 4
    out = _run("train_dpo.py", f"--init_from={sft}", f"--workdir={dpo}", "--max_steps=4", "--log_every=2", *toy)
    # Before training the policy is the reference: every margin is 0, a tie, and the DPO loss is log 2.
    assert re.search(r"eval DPO loss before training: 0\.6931, preference accuracy 0\.0000", out.stdout), out.stdout
    assert len(_losses(out.stdout)) == 2
    assert json.loads((dpo / "run.json").read_text())["task"] == "dpo" and _steps(dpo)[-1] == 4
    gen = _run("generate.py", f"--workdir={dpo}", "--prompts=owl", "--max_new_tokens=3")
    assert "--- 'owl':" in gen.stdout


@pytest.mark.slow
def test_sft_reward_model_ppo_and_generate(tmp_path):
    """The RLHF pipeline on the toy task, each script reading the previous one's workdir on a 4x1x2 mesh: SFT with
    LoRA adapters, a reward model from the SFT checkpoint (its adapters merged), PPO from both (stopped
    mid-iteration and resumed), PPO with the toy rule reward, GRPO with the reward model and with exact-match
    rewards on jsonl reference answers, PPO with LoRA adapters on actor and critic and the
    reward model exported (export_hf.py) as a transformers sequence classifier, generate.py on the PPO workdir, and
    the PPO policy exported as a causal language model."""
    sft, rm, ppo, rule = (tmp_path / name for name in ("sft", "rm", "ppo", "rule"))
    toy = ["--toy_size=64", "--eval_size=16", "--per_device_batch_size=1", "--mesh=-1,1,2", "--log_every=2"]
    _run("train_sft.py", f"--workdir={sft}", "--max_steps=4", "--seq_len=24", "--eval_answers=2",
         "--max_new_tokens=4", "--lora_rank=4", "--lora_targets=q,v,down", "--lora_dropout=0.1", *toy)
    # Only the adapters trained: every other weight is still the fresh model's (seed 0).
    _, sft_model, sft_params, _ = run_record.restore_run(str(sft), engine.make_mesh())
    assert sft_model.config.lora_rank == 4 and sft_model.config.lora_targets == ("q", "v", "down")
    fresh = models.init_params(models.lora.without_lora(sft_model), jax.random.PRNGKey(0))
    assert jax.tree.structure(models.merge_lora(sft_model, sft_params)[1]) == jax.tree.structure(fresh)
    base = {engine.sharding.path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(sft_params)[0]
            if "lora" not in engine.sharding.path_str(p)}
    for path, x in jax.tree_util.tree_flatten_with_path(fresh)[0]:
        np.testing.assert_array_equal(np.asarray(base[engine.sharding.path_str(path)]), np.asarray(x))
    assert any(np.abs(np.asarray(x)).max() > 0 for p, x in jax.tree_util.tree_flatten_with_path(sft_params)[0]
               if engine.sharding.path_str(p).endswith("lora_b"))
    out = _run("train_reward.py", f"--init_from={sft}", f"--workdir={rm}", "--max_steps=4", "--seq_len=24", *toy)
    assert re.search(r"eval reward loss after training: [0-9.]+ \(was [0-9.]+\), accuracy", out.stdout), out.stdout
    assert json.loads((rm / "run.json").read_text())["task"] == "reward"
    ppo_args = [f"--init_from={sft}", f"--reward_from={rm}", f"--workdir={ppo}", "--rollout_batch_size=8",
                "--max_new_tokens=6", "--eval_answers=4", *toy]
    out = _run("train_ppo.py", "--max_steps=3", *ppo_args)  # iterations of 2 updates: stops mid-iteration 1
    assert re.findall(r"^iteration +(\d+) +step +(\d+) +reward", out.stdout, re.M) == [("1", "2")], out.stdout
    assert (ppo / "ppo_experience-1.npz").exists() and _steps(ppo)[-1] == 3
    out = _run("train_ppo.py", "--max_steps=6", *ppo_args)
    assert "resumed from" in out.stdout and _steps(ppo)[-1] == 6
    assert re.findall(r"^iteration +(\d+) +step +(\d+) +reward", out.stdout, re.M) == [("2", "4"), ("3", "6")]
    assert re.search(r"after training \(step 6\): greedy answers' mean reward -?[0-9.]+, exact match", out.stdout)
    run = json.loads((ppo / "run.json").read_text())
    assert run["task"] == "ppo" and run["critic"]["family"] == "llama"
    out = _run("train_ppo.py", f"--init_from={sft}", f"--workdir={rule}", "--rollout_batch_size=8", "--max_steps=2",
               "--max_new_tokens=6", "--eval_answers=4", *toy)
    assert re.findall(r"^iteration +1 +step +2 +reward -?[0-9.]+ ", out.stdout, re.M), out.stdout
    # GRPO: no critic, the reward model frozen with its own (here int8) weights; generate.py reads the policy back.
    grpo = tmp_path / "grpo"
    out = _run("train_ppo.py", f"--init_from={sft}", f"--reward_from={rm}", f"--workdir={grpo}",
               "--advantage_estimator=grpo", "--samples_per_prompt=2", "--rollout_batch_size=8", "--max_steps=2",
               "--max_new_tokens=6", "--eval_answers=4", "--lora_rank=2", "--quantize=int8", *toy)
    assert "iterations of 8 rollouts (4 prompts x 2) and 2 updates" in out.stdout, out.stdout
    assert re.findall(r"^iteration +1 +step +2 +reward -?[0-9.]+ ", out.stdout, re.M), out.stdout
    assert "critic" not in json.loads((grpo / "run.json").read_text())
    gen = _run("generate.py", f"--workdir={grpo}", "--prompts=owl cat", "--max_new_tokens=3")
    assert "--- 'owl cat':" in gen.stdout
    # RL with verifiable rewards: GRPO on jsonl prompts with reference answers, scored by exact match.
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps(p) + "\n" for p in preference.toy_prompt_responses(48, seed=5)))
    out = _run("train_ppo.py", f"--init_from={sft}", f"--workdir={tmp_path / 'rlvr'}", f"--data={answers}",
               "--verifiable_reward=exact_match", "--advantage_estimator=grpo", "--samples_per_prompt=2",
               "--rollout_batch_size=8", "--max_steps=2", "--max_new_tokens=6", "--eval_answers=4", *toy)
    assert "32 training prompts" in out.stdout, out.stdout
    scores = re.findall(r"^iteration +1 +step +2 +reward (-?[0-9.]+) ", out.stdout, re.M)
    assert scores and abs(float(scores[0]) * 8 - round(float(scores[0]) * 8)) < 0.01, out.stdout  # 8 of 1, 0 or -5
    assert re.search(r"after training \(step 2\): greedy answers' mean reward -?[0-9.]+, exact match", out.stdout)
    # The reward model exported as a transformers sequence classifier serves PPO the same way.
    out = _run("export_hf.py", f"--workdir={rm}", f"--out={tmp_path / 'rm_hf'}")
    assert "as a Hugging Face sequence classifier" in out.stdout
    _, rm_model, rm_params, _ = run_record.restore_run(str(rm), engine.make_mesh(), tasks=("reward",))
    again_model, again = models.load_reward_model(str(tmp_path / "rm_hf"))
    assert again_model.config.hidden_size == rm_model.config.hidden_size
    used = lambda p: {"score": p["score"], **{k: v for k, v in p["backbone"].items() if k != "lm_head"}}  # noqa
    for a, b in zip(jax.tree.leaves(used(rm_params)), jax.tree.leaves(used(again))):  # the LM head is not exported
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    out = _run("train_ppo.py", f"--init_from={sft}", f"--reward_from={tmp_path / 'rm_hf'}",
               f"--workdir={tmp_path / 'ppo_hf'}", "--rollout_batch_size=8", "--max_steps=2", "--max_new_tokens=6",
               "--eval_answers=4", "--lora_rank=2", "--critic_learning_rate=1e-3", *toy)
    assert re.findall(r"^iteration +1 +step +2 +reward -?[0-9.]+ ", out.stdout, re.M), out.stdout
    run = json.loads((tmp_path / "ppo_hf" / "run.json").read_text())
    assert run["config"]["lora_rank"] == 2 and run["critic"]["config"]["lora_rank"] == 2
    gen = _run("generate.py", f"--workdir={ppo}", "--prompts=owl cat", "--max_new_tokens=3")
    assert "--- 'owl cat':" in gen.stdout
    refused = _run("export_hf.py", f"--workdir={ppo}", f"--out={tmp_path / 'ppo_hf'}", ok=False)  # a workdir
    assert refused.returncode == 2 and f"--out={tmp_path / 'ppo_hf'} is not empty (" in refused.stderr
    (tmp_path / "ppo_export").mkdir()  # an earlier export's files, which this run's would be read beside
    for stale in ("tokenizer.model", "adapter_config.json", "model-00001-of-00002.safetensors", "notes.txt"):
        (tmp_path / "ppo_export" / stale).write_text("stale")
    out = _run("export_hf.py", f"--workdir={ppo}", f"--out={tmp_path / 'ppo_export'}", "--overwrite")
    assert "as a Hugging Face causal language model" in out.stdout
    assert sorted(os.listdir(tmp_path / "ppo_export")) == ["config.json", "model.safetensors", "notes.txt"]
    assert json.loads((tmp_path / "ppo_export" / "config.json").read_text())["eos_token_id"] == 2  # the word tokens'
    model, params = models.load_pretrained(str(tmp_path / "ppo_export"))
    _, _, actor, _ = run_record.restore_run(str(ppo), engine.make_mesh())
    for a, b in zip(jax.tree.leaves(actor), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_lora_sft_on_a_hugging_face_model_exports_a_peft_adapter_that_the_next_run_reads(tmp_path):
    """SFT with adapters on a Hugging Face directory; export_hf.py --adapter_only writes the PEFT adapter; a run from
    the same directory with --init_adapter starts from the trained model: its loss before training is the first
    run's loss after training. That run, without adapters of its own, has none to export."""
    _tiny_hf("llama", tmp_path / "hf")
    toy = [f"--init_from={tmp_path / 'hf'}", "--tokenizer=byte", "--toy_size=64", "--eval_size=16", "--per_device_batch_size=1",
           "--mesh=-1,1,2", "--seq_len=48", "--eval_answers=0"]
    out = _run("train_sft.py", f"--workdir={tmp_path / 'a'}", "--max_steps=6", "--log_every=3", "--lora_rank=4",
               "--learning_rate=1e-2", *toy)
    after = re.search(r"eval response loss after training: ([0-9.]+) \(was ([0-9.]+)\)", out.stdout)
    assert after and float(after[1]) < float(after[2]), out.stdout
    out = _run("export_hf.py", f"--workdir={tmp_path / 'a'}", f"--out={tmp_path / 'adapter'}", "--adapter_only")
    assert "as a PEFT adapter" in out.stdout and (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    out = _run("train_sft.py", f"--workdir={tmp_path / 'b'}", "--max_steps=1", "--log_every=1",
               f"--init_adapter={tmp_path / 'adapter'}", *toy)
    before = re.search(r"eval response loss before training: ([0-9.]+)", out.stdout)
    assert before and abs(float(before[1]) - float(after[1])) < 1e-3, (before[1], after[1])
    gen = _run("generate.py", f"--init_from={tmp_path / 'hf'}", "--tokenizer=byte", f"--init_adapter={tmp_path / 'adapter'}",
               "--quantize=int8", "--kv_cache_dtype=int8", "--prompts=owl cat", "--max_new_tokens=3")
    assert "--- 'owl cat':" in gen.stdout
    bad = _run("export_hf.py", f"--workdir={tmp_path / 'b'}", f"--out={tmp_path / 'x'}", "--adapter_only", ok=False)
    assert bad.returncode == 2 and "without LoRA adapters" in bad.stderr
    # Adapters on an nf4 base (int8 trains in tests/test_lora.py): the run records it, trains, and exports
    # (dequantised, merged) for transformers.
    out = _run("train_sft.py", f"--workdir={tmp_path / 'c'}", "--max_steps=6", "--log_every=3", "--lora_rank=4",
               "--quantize=nf4", "--learning_rate=1e-2", *toy)
    after = re.search(r"eval response loss after training: ([0-9.]+) \(was ([0-9.]+)\)", out.stdout)
    assert after and float(after[1]) < float(after[2]), out.stdout
    assert json.loads((tmp_path / "c" / "run.json").read_text())["config"]["quantize"] == "nf4"
    _run("export_hf.py", f"--workdir={tmp_path / 'c'}", f"--out={tmp_path / 'c_hf'}")
    model, params = models.load_pretrained(str(tmp_path / "c_hf"))
    assert model.config.quantize is None and params["layers_0"]["attn"]["q"]["kernel"].dtype == np.float32
    # Its adapters alone learnt the nf4 base's weights: the export says so.
    out = _run("export_hf.py", f"--workdir={tmp_path / 'c'}", f"--out={tmp_path / 'c_adapter'}", "--adapter_only")
    assert "--adapter_only: the adapters were trained on the nf4-quantized base" in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gptj", "opt"])
def test_train_lm_fine_tunes_a_hugging_face_directory(tmp_path, family):
    _tiny_hf(family, tmp_path / "hf")
    out = _run("train_lm.py", f"--init_from={tmp_path / 'hf'}", "--tokenizer=byte", f"--data={_stdlib_txt(tmp_path / 'data' / 'a.txt')}",
               f"--workdir={tmp_path / 'work'}", "--max_steps=8", "--log_every=4", "--seq_len=16",
               "--per_device_batch_size=1", "--mesh=2,2,2", "--learning_rate=1e-2", "--warmup_steps=2", "--prompts=",
               "--dropout_rate=0.05", "--attention_dropout_rate=0.05")
    before, after = _eval_losses(out.stdout)
    assert after < 0.95 * before
    assert json.loads((tmp_path / "work" / "run.json").read_text())["family"] == family


@pytest.mark.slow  # CI time (27 s); the T5 task's loss and packing: tests/test_text_and_scripts.py
def test_finetune_seq2seq_resumes_and_generate_reads_its_workdir(tmp_path):
    args = [f"--workdir={tmp_path}", "--toy_size=64", "--eval_size=16", "--log_every=4", "--save_every=4",
            "--per_device_batch_size=2", "--mesh=4,1,2", "--learning_rate=1e-2", "--samples=2",
            '--model_overrides={"d_model": 32, "d_ff": 64, "num_layers": 1, "num_heads": 2, "d_kv": 16}']
    out = _run("finetune_seq2seq.py", "--max_steps=8", *args)
    losses = _losses(out.stdout)
    before, after = _eval_losses(out.stdout)
    assert len(losses) == 2 and losses[-1] < losses[0] and after < before
    assert "model TFLOP/s per device" in out.stdout
    assert re.search(r"eval exact match: [0-9.]+ on 16 held-out pairs", out.stdout)
    assert out.stdout.count("(target '") == 2
    assert any(f.startswith("events.out.tfevents") for f in _files(tmp_path / "tensorboard"))
    assert _steps(tmp_path)[-1] == 8
    assert json.loads((tmp_path / "run.json").read_text())["tokenizer"]["kind"] == "words"

    again = _run("finetune_seq2seq.py", "--max_steps=12", *args)
    assert "resumed from" in again.stdout and "at step 12" in again.stdout and _steps(tmp_path)[-1] == 12

    gen = _run("generate.py", f"--workdir={tmp_path}", "--prompts=owl cat yak", "--max_new_tokens=4", "--num_beams=2",
               "--early_stopping=never")
    words = gen.stdout.split("--- 'owl cat yak':\n")[1].split()
    assert 1 <= len(words) <= 4 and set(words) <= set(text_data.TOY_WORDS) | {"<unk>"}


def _bad_inputs(tmp_path, slow):
    """{(script, *flags): expected part of the error line}: the inputs the issue lists by default (unknown model,
    a mesh that does not fit, a missing data file, empty data, bad JSON), the others with -m slow."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "a", "input": "a", "target": "b"}\n{oops\n')
    (tmp_path / "config.json").write_text('{"hidden_size": ')
    (tmp_path / "t5run").mkdir()
    (tmp_path / "t5run" / "run.json").write_text('{"task": "seq2seq", "family": "t5", "config": {}}')
    (tmp_path / "rmrun").mkdir()
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "cat owl"}\n')
    (tmp_path / "answers.jsonl").write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in (
        ("cat owl", "cat owl"), ("dog", "dog"), ("cat owl", "owl cat"))))
    (tmp_path / "rmrun" / "run.json").write_text('{"task": "reward", "family": "llama", "config": {}}')
    pq.write_table(pa.table({"question": ["cat owl"] * 3, "completion": ["owl cat"] * 3}), tmp_path / "qa.parquet")
    (tmp_path / "latin1.txt").write_bytes("def café():\n".encode("latin-1"))
    _tiny_hf("llama", tmp_path / "hf_no_tokenizer")
    _tiny_hf("opt", tmp_path / "hf_opt")  # 128 learned positions
    for name, rate in (("ppo_shared", None), ("ppo_apart", 1e-3)):  # PPO runs that saved step 2, one optimizer or two
        (tmp_path / name / "checkpoints" / "2").mkdir(parents=True)
        (tmp_path / name / "run.json").write_text(json.dumps({"task": "ppo", "training": {
            "critic_learning_rate": rate, "since": 0}}))
    if not slow:
        return {
            ("export_hf.py", f"--out={tmp_path}"): f"--out={tmp_path} is not empty (",
            # Refused in one line (before the models load, as it happens; a fresh model here would build).
            ("train_ppo.py", f"--workdir={tmp_path / 'ppo_shared'}", "--critic_learning_rate=1e-3"):
                f"--critic_learning_rate=0.001 where the run in {tmp_path / 'ppo_shared'} had it unset: the critic "
                "would get an optimizer of its own, whose state its checkpoints do not hold; expected "
                "--critic_learning_rate unset to resume it",
            ("train_lm.py", f"--data={tmp_path / 'latin1.txt'}"): "latin1.txt: not UTF-8 at byte 7",
            ("train_lm.py", f"--compilation_cache_dir={tmp_path / 'empty.txt' / 'cache'}"): (
                f"--compilation_cache_dir={tmp_path / 'empty.txt' / 'cache'}: cannot create "
                f"{tmp_path / 'empty.txt' / 'cache'} (Not a directory); expected a directory"),
            ("train_lm.py", f"--init_from={tmp_path / 'hf_no_tokenizer'}"): "has neither tokenizer.json nor "
                                                                              "tokenizer.model; pass --tokenizer=",
            ("train_lm.py", "--tokenizer=/nonexistent.json"): "--tokenizer=/nonexistent.json: no such file",
            ("train_lm.py", "--model=bert"): "--model=bert: value should be one of",
            ("train_lm.py", "--mesh=3,1,1"): "3 devices, but 8 devices are available",
            ("train_lm.py", "--data=/nonexistent/*.txt"): "matches no file",
            ("train_lm.py", f"--data={tmp_path / 'empty.txt'}"): "holds no text",
            ("train_lm.py", f"--data={tmp_path / 'latin1.txt'}:1,{tmp_path / 'empty.txt'}:1", "--data_workers=1"):
                "--data_workers=1 with a mixture --data; a mixture is a stream",
            ("train_lm.py", "--model_overrides={oops"): "--model_overrides='{oops' is not JSON",
            ("finetune_seq2seq.py", "--model_config=t5-huge"): "--model_config='t5-huge' is not a config of t5",
            ("finetune_seq2seq.py", "--data=/nonexistent.jsonl"): "matches no file",
            ("finetune_seq2seq.py", f"--data={tmp_path / 'empty.jsonl'}"): "holds no pairs",
            ("finetune_seq2seq.py", f"--eval_data={tmp_path / 'bad.jsonl'}"): "bad.jsonl:2 is not JSON",
            ("generate.py", "--prompts=x", f"--workdir={tmp_path}"): "has no run.json",
            ("generate.py", "--workdir=/nonexistent"): "no prompts",
            ("train_dpo.py", f"--data={tmp_path / 'bad.jsonl'}"): "bad.jsonl:1 is not an object with string fields "
                                                                 "'prompt', 'chosen' and 'rejected'",
            ("train_sft.py", f"--data={tmp_path / 'bad.jsonl'}"): "bad.jsonl:1 is not an object with string fields "
                                                                 "'prompt' and 'response'",
            ("train_reward.py", f"--data={tmp_path / 'bad.jsonl'}"): "bad.jsonl:1 is not an object with string "
                                                                    "fields 'prompt', 'chosen' and 'rejected'",
            ("train_ppo.py", f"--data={tmp_path / 'bad.jsonl'}"): "--reward_from is empty",
            ("export_hf.py", f"--workdir={tmp_path}", f"--out={tmp_path / 'x'}"): "has no run.json",
            ("export_hf.py", f"--out={tmp_path / 'empty.txt'}"): f"--out={tmp_path / 'empty.txt'} is a file; expected "
                                                                 "a directory",
            ("export_hf.py", f"--out={tmp_path / 'rmrun'}", "--overwrite"): f"--out={tmp_path / 'rmrun'} is a "
                                                                           "training workdir (it holds run.json)",
            ("train_ppo.py", "--model=opt", '--model_overrides={"max_position_embeddings": 8}'):
                "with a model of 8 learned positions (its max_position_embeddings); expected shorter prompts or a "
                "smaller --max_new_tokens",
            ("train_lm.py", "--save_best=loss"): "--save_best=loss; expected METRIC:min or METRIC:max",
            ("train_sft.py", "--eval_every=-2"): "--eval_every=-2; expected an integer >= 0",
            # The Parquet records read, their fields from the named columns: the error is the prompt's length.
            ("train_sft.py", f"--data={tmp_path / 'qa.parquet'}", "--eval_size=1", "--seq_len=4",
             "--record_columns=prompt:question,response:completion"): "seq_len=4: pair 0's prompt takes",
            ("train_sft.py", f"--data={tmp_path / 'qa.parquet'}", "--record_columns=prompt:question",
             "--eval_size=1"): "qa.parquet has no column 'response'; its columns: question, completion; "
                               "--record_columns=FIELD:NAME,... reads",
            ("train_dpo.py", "--record_columns=chosen"): "--record_columns=chosen: 'chosen' is not FIELD:NAME",
            ("train_dpo.py", "--early_stopping_patience=3"): "--early_stopping_patience=3; expected 0, or an "
                                                             "integer >= 1 with --save_best",
            ("train_reward.py", "--adam_b2=1"): "--adam_b2=1.0; expected in [0, 1)",
            ("generate.py", "--prompts=x", "--num_beams=2", "--temperature=0.5"): "expected beam search without "
                                                                                  "sampling",
        }
    return {
        ("train_lm.py", "--model_config=huge"): "--model_config='huge' is not a config of llama",
        ("train_lm.py", f"--model_config={tmp_path / 'config.json'}"): "config.json is not JSON",
        ("train_lm.py", '--model_overrides={"width": 1}'): "llama config has no field(s) ['width']",
        ("finetune_seq2seq.py", '--model_overrides={"vocab_size": 10}'): "vocab_size=10; the WordTokenizer needs at "
                                                                          "least",
        ("train_lm.py", f"--data={tmp_path / 'bad.jsonl'}"): "bad.jsonl:2 is not JSON",
        ("train_lm.py", "--init_from=/nonexistent"): "--init_from=/nonexistent is not a directory",
        ("train_lm.py", "--profile_steps=5"): "--profile_steps=5; expected START,END",
        ("train_lm.py", "--per_device_batch_size=0"): "--per_device_batch_size=0; expected an integer >= 1",
        ("train_ppo.py", "--mesh=auto"): "--mesh=auto; expected integers data,fsdp,model[,expert] such as 2,2,2 (this "
                                         f"script does not choose a layout: {script_flags.AUTO_MESH_SCRIPTS} do)",
        ("train_sft.py", "--mesh_memory_gb=8"): "--mesh_memory_gb=8.0 with --mesh=-1,1,1; expected a positive "
                                                "budget with --mesh=auto",
        ("train_lm.py", "--mesh_memory_gb=8"): "--mesh_memory_gb=8.0 with --mesh=-1,1,1; expected a positive budget "
                                               "with --mesh=auto",
        ("finetune_seq2seq.py", "--mesh=1,1"): "--mesh='1,1'; expected three or four integers",
        ("finetune_seq2seq.py", "--dropout_rate=1.5"): "--dropout_rate=1.5: 1.5 is not a number in the range",
        ("generate.py", "--prompts_file=/nonexistent.txt"): "--prompts_file=/nonexistent.txt: no such file",
        ("generate.py", "--prompts=x", "stray"): "unexpected arguments ['stray']",
        ("train_dpo.py", "--beta=0"): "--beta=0: 0.0 is not number >= 1e-06",
        ("train_dpo.py", "--record_columns=chosen:better"): "--record_columns names the columns of --data / "
                                                            "--eval_data files, and neither is given",
        ("finetune_seq2seq.py", f"--data={tmp_path / 'qa.parquet'}", "--record_columns=question:input"):
            "record_columns names 'question', which is not a field of these records; expected some of 'input' and "
            "'target'",
        ("train_dpo.py", "--seq_len=4"): "seq_len=4: triple 0's prompt takes",
        ("train_sft.py", "--seq_len=4"): "seq_len=4: pair 0's prompt takes",
        ("train_sft.py", f"--init_from={tmp_path / 't5run'}"): "holds a seq2seq run; expected one of ['lm', 'sft']",
        ("train_lm.py", f"--init_from={tmp_path / 'rmrun'}"): f"--init_from={tmp_path / 'rmrun'} is a training "
            "script's workdir, which this script does not start from; expected a Hugging Face model directory",
        ("train_ppo.py", f"--reward_from={tmp_path / 't5run'}"): "holds a seq2seq run; expected one of ['reward']",
        ("train_ppo.py", "--rollout_batch_size=12"): "--rollout_batch_size=12; expected a positive multiple of the "
                                                     "global batch (128 rows)",
        ("train_ppo.py", "--advantage_estimator=grpo", "--samples_per_prompt=3", "--rollout_batch_size=128"):
            "--rollout_batch_size=128; expected a positive multiple of the global batch (128 rows) and of "
            "--samples_per_prompt (3)",
        ("train_ppo.py", f"--workdir={tmp_path / 'ppo_apart'}"): f"--critic_learning_rate unset where the run in "
            f"{tmp_path / 'ppo_apart'} had 0.001: its checkpoints hold the critic's optimizer state apart",
        ("train_ppo.py", "--advantage_estimator=grpo", "--critic_learning_rate=1e-3"): "--critic_learning_rate with "
            "--advantage_estimator=grpo; expected neither (GRPO has no critic)",
        ("train_ppo.py", "--advantage_estimator=grpo", "--samples_per_prompt=1"): "--samples_per_prompt=1 with "
            "--advantage_estimator=grpo; expected at least 2",
        ("train_ppo.py", "--noscale_rewards"): "--scale_rewards with --advantage_estimator=gae; expected it with grpo",
        ("train_ppo.py", "--verifiable_reward=lcs", "--reward_from=rm"): "--reward_from=rm with "
            "--verifiable_reward=lcs; expected one of them",
        ("train_ppo.py", f"--data={tmp_path / 'prompts.jsonl'}", "--verifiable_reward=exact_match"):
            "prompts.jsonl:1 is not an object with string fields 'prompt' and 'response'",
        ("train_sft.py", f"--data={tmp_path / 'answers.jsonl'}", f"--eval_data={tmp_path}/answers.jsonl"):
            f"--eval_data names {tmp_path / 'answers.jsonl'}, which --data trains on; expected held-out files, or no "
            "--eval_data (the last --eval_size pairs of --data are held out)",
        ("train_ppo.py", f"--data={tmp_path / 'answers.jsonl'}", "--eval_size=1", "--verifiable_reward=lcs"):
            "pair 2: prompt 'cat owl' has two reference answers",
        ("generate.py", "--prompts=x", f"--workdir={tmp_path / 'rmrun'}"): "holds a reward run; expected one of",
        ("train_sft.py", "--lora_rank=4", "--lora_targets=q,qkv"): "--lora_rank/--lora_alpha/--lora_targets: "
                                                                    "lora_targets=('q', 'qkv'); expected",
        ("train_dpo.py", "--quantize=int8"): "--quantize=int8 with --lora_rank=0; expected --lora_rank > 0",
        ("train_lm.py", f"--init_from={tmp_path / 'hf_opt'}", "--tokenizer=byte", "--seq_len=256"):
            "--seq_len=256 with a model of 128 learned positions (its max_position_embeddings); expected --seq_len <= "
            "128",
        ("generate.py", f"--init_from={tmp_path / 'hf_opt'}", "--tokenizer=byte", "--prompts=" + "x" * 120,
         "--max_new_tokens=16"): "prompt 0 (120 tokens) and max_new_tokens=16 reach position 135, past the model's "
                                 "128 learned positions",
        ("train_sft.py", "--lora_rank=2", "--quantize=nf4", '--model_overrides={"hidden_size": 32}'):
            "--quantize=nf4: layers_0/attn/k/kernel: weight.shape=(32, 16); nf4 needs its rows K a multiple of 64; "
            "expected --quantize=int8",
        ("train_lm.py", "--pipeline_stages=0"): "--pipeline_stages=0; expected an integer >= 1",
        ("train_lm.py", "--zero_quantized_weights"): "zero_quantized_weights=True; expected False on a mesh with "
                                                     "fsdp=1",
        ("train_lm.py", "--diloco_fragments=2"): "--diloco_fragments=2 --diloco_outer_dtype=float32 "
                                                 "--diloco_overlap=False; expected --diloco_inner_steps > 0",
        ("train_sft.py", "--diloco_inner_steps=2", "--diloco_fragments=3"): "--diloco_fragments=3; expected at most "
                                                                            "--diloco_inner_steps=2",
        ("finetune_seq2seq.py", "--pipeline_stages=2"): "--pipeline_stages=2: a pipeline needs a decoder-only model",
    }


def _check_bad_inputs(tmp_path, slow):
    cases = _bad_inputs(tmp_path, slow)
    work = f"--workdir={tmp_path / 'w'}"
    # Every case fails during start-up: one interpreter imports JAX and the engine once and forks a child per case.
    results = run_scripts([(case[0], work, *case[1:]) for case in cases], env=ENV, cwd=ROOT)
    for case, (returncode, _, stderr) in zip(cases, results):
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert returncode == 2 and len(errors) == 1 and "Traceback" not in stderr, (case, stderr[-2000:])
        assert cases[case] in errors[0], (case, errors[0])
    assert not os.path.exists(tmp_path / "w" / "run.json")  # no failed start leaves a run behind


def test_bad_flags_end_with_one_error_line(tmp_path):
    _check_bad_inputs(tmp_path, slow=False)


@pytest.mark.slow
def test_more_bad_flags_end_with_one_error_line(tmp_path):
    _check_bad_inputs(tmp_path, slow=True)


@pytest.mark.slow
def test_finetune_seq2seq_fine_tunes_a_hugging_face_t5(tmp_path):
    """T5 from a Hugging Face directory (byte-level tokens: it has no tokenizer.json) on jsonl pairs, packed several
    to a row."""
    _tiny_hf("t5", tmp_path / "hf")
    pairs = seq2seq.toy_pairs(48, seed=3)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    out = _run("finetune_seq2seq.py", f"--init_from={tmp_path / 'hf'}", "--tokenizer=byte", f"--data={data}", f"--workdir={tmp_path / 'w'}",
               "--eval_size=8", "--max_steps=8", "--log_every=4", "--per_device_batch_size=1", "--mesh=2,2,2",
               "--learning_rate=1e-2", "--warmup_steps=2", "--samples=1", "--pack_pairs", "--max_input_len=64",
               "--max_target_len=64")
    assert re.search(r"40 training \(packed into \d+ rows\)", out.stdout), out.stdout
    before, after = _eval_losses(out.stdout)
    assert after < 0.95 * before
    assert json.loads((tmp_path / "w" / "run.json").read_text())["family"] == "t5"
    # LoRA on the same model: the adapters train, and export as a PEFT seq2seq adapter.
    out = _run("finetune_seq2seq.py", f"--init_from={tmp_path / 'hf'}", "--tokenizer=byte", f"--data={data}", f"--workdir={tmp_path / 'l'}",
               "--eval_size=8", "--max_steps=6", "--log_every=3", "--per_device_batch_size=1", "--mesh=2,2,2",
               "--learning_rate=3e-2", "--warmup_steps=1", "--samples=0", "--lora_rank=4", "--lora_targets=q,v,up")
    before, after = _eval_losses(out.stdout)
    assert after < before and json.loads((tmp_path / "l" / "run.json").read_text())["config"]["lora_rank"] == 4
    _run("export_hf.py", f"--workdir={tmp_path / 'l'}", f"--out={tmp_path / 'adapter'}", "--adapter_only")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    # The tiny T5 is gated (v1.1): "up" is wi_1.
    assert config["task_type"] == "SEQ_2_SEQ_LM" and config["target_modules"] == ["q", "v", "wi_1"], config


def test_check_kernels_passes_a_kernel_and_catches_a_one_percent_error():
    """scripts/check_kernels.py (the on-device correctness check), in Pallas's interpreter on CPU. The engine's
    script flags an earlier test of this process defined are set aside while it defines its own (`--seed` is in
    both), and its own removed again, so that tests before and after it may define the engine's."""
    import importlib.util

    import jax.numpy as jnp
    import kernels
    from absl import flags
    parked = {f.name: f for module, defined in flags.FLAGS.flags_by_module_dict().items()
              if module.startswith("engine.") for f in defined}
    for name in parked:
        delattr(flags.FLAGS, name)
    before = set(flags.FLAGS)
    spec = importlib.util.spec_from_file_location("check_kernels", os.path.join(ROOT, "scripts", "check_kernels.py"))
    check_kernels = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(check_kernels)
    finally:
        for name in set(flags.FLAGS) - before:
            delattr(flags.FLAGS, name)
        for name, flag in parked.items():
            flags.FLAGS[name] = flag
    impl = {"implementation": "triton", "interpret": True}
    key = jax.random.key(0)
    gated = lambda impl, x, g, u: kernels.gated_mlp(x, g, u, **impl)  # noqa: E731
    error, _, plain, seconds = check_kernels.check("gated_mlp", gated, [(24, 32), (32, 48), (32, 48)], jnp.float32,
                                                   impl, key)
    assert error <= check_kernels.LIMITS["float32"] and check_kernels.passes(error, plain, "float32")
    assert set(seconds) == {"ours", "xla", "reference"} and all(s >= 0 for s in seconds.values())
    off = lambda impl, x, g, u: gated(impl, x, g, u) * (1.01 if impl.get("interpret") else 1.0)  # noqa: E731
    for reference in ("host", "device"):  # the same row, its float32 reference on the CPU or the default device
        error, part, plain, _ = check_kernels.check("gated_mlp", off, [(24, 32), (32, 48), (32, 48)], jnp.float32,
                                                    impl, key, reference=reference)
        assert 5e-3 < error < 2e-2 and plain < 1e-5, (error, part, plain)
    assert not check_kernels.passes(error, plain, "float32")
    assert not check_kernels.passes(float("inf"), float("inf"), "bfloat16")  # NaN fails even where XLA's is NaN
    rows = {c.name: c.dtypes for c in check_kernels.cases("small", cudnn=True)}  # an NVIDIA GPU's rows
    assert {n: d for n, d in rows.items() if "cudnn" in n} == {
        "flash_attention[cudnn] causal GQA": ("bfloat16", "float16"),
        "flash_attention[cudnn] causal segments": ("bfloat16", "float16")}
    assert not any("cudnn" in c.name for c in check_kernels.cases("small"))


@pytest.mark.slow
def test_bench_kernels_tunes_every_pallas_op_in_interpret_mode():
    """--tune over interpreted Triton kernels (two candidates each): one table per op and pass, fastest first,
    with the XLA baseline and each row's speed relative to the default."""
    out = _run("bench_kernels.py", "--tune=attention,matmul", "--implementation=triton", "--interpret",
               "--max_candidates=2", "--seq_lens=64", "--tokens=64", "--heads=2", "--head_dim=16", "--iters=1",
               "--warmup=1", "--causal=true")
    tables = out.stdout.split("\n## ")[1:]
    titles = [t.splitlines()[0] for t in tables]
    for op in ("flash_attention", "fused_matmul", "gated_mlp", "linear_cross_entropy"):
        assert sum(title.startswith(f"tune {op}[triton] fwd") for title in titles) == 2, titles
    for table in tables:
        lines = [line for line in table.splitlines() if line.strip()]
        starts = [m.start() for m in re.finditer(r"-+", lines[2])]  # the column rule under the header
        rows = [[line[a:b].strip() for a, b in zip(starts, starts[1:] + [None])] for line in lines[3:]]
        assert len(rows) == 3 and [r[0] for r in rows].count("default") == 1, table  # baseline, default, candidate
        times = [float(r[2]) for r in rows]
        assert times == sorted(times), table
        assert [r[-1] for r in rows if r[0] == "default"] == ["1.00x default"], table


def test_bench_kernels_prints_every_table():
    out = _run("bench_kernels.py", "--kernels=attention,matmul,decode", "--seq_lens=64", "--iters=1", "--warmup=1",
               "--causal=true")
    for row in ("flash_attention[xla] fwd+bwd", "jax.nn[xla] fwd", "gated_mlp[xla] fwd", "xla materialised logits",
                "fused_matmul int8[xla] fwd+bwd", "decode_attention[xla]  B2 cache 256/512"):
        assert row in out.stdout, out.stdout
    assert re.search(r"decode_attention\[xla\] .* \d+ GB/s", out.stdout), out.stdout


def _scalars(logdir):
    """{tag: [(step, value)]} of the TensorBoard event files under logdir (TFRecord frames of Event protos)."""
    import struct

    from tensorboardX.proto import event_pb2
    scalars = {}
    for name in sorted(_files(logdir)):
        if not name.startswith("events.out.tfevents"):
            continue
        data = next(os.path.join(d, name) for d, _, fs in os.walk(logdir) if name in fs)
        raw, at = open(data, "rb").read(), 0
        while at < len(raw):
            (length,) = struct.unpack("<Q", raw[at:at + 8])
            event = event_pb2.Event.FromString(raw[at + 12:at + 12 + length])
            at += 16 + length
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


@pytest.mark.slow  # CI time (two script runs, 20 s); CI keeps the cache's unit test and the Trainer's log line
def test_a_rerun_loads_the_step_from_the_compilation_cache(tmp_path):
    """--compilation_cache_dir keeps what the first run compiled: the same command on a new workdir loads the train
    step (and the other programs slow enough to be kept) from it instead of compiling, and trains alike."""
    cache = tmp_path / "cache"
    run = ["--max_steps=2", "--prompts=", f"--compilation_cache_dir={cache}", *TINY_LM]
    # JAX keeps programs that took a second or more to compile; this tiny step may take less on a fast machine.
    env = dict(ENV, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    first = _run("train_lm.py", f"--workdir={tmp_path / 'a'}", *run, env=env)
    assert re.search(r"train step \(step=\w+\) compiled in [0-9.]+ s", first.stderr), first.stderr[-2000:]
    assert any(name.endswith("-cache") for name in os.listdir(cache)), os.listdir(cache)
    again = _run("train_lm.py", f"--workdir={tmp_path / 'b'}", *run, env=env)
    assert re.search(r"train step \(step=\w+\) loaded from the compilation cache in [0-9.]+ s",
                     again.stderr), again.stderr[-2000:]
    assert _eval_losses(again.stdout) == _eval_losses(first.stdout)


@pytest.mark.slow  # CI time; TensorBoard files: the main job's test
def test_console_shows_the_project_lines_and_tensorboard_every_eval(tmp_path):
    """The default console: the script's own lines only (no Orbax or JAX INFO, no parameter table), everything in
    the workdir's log.txt; the evals the script prints, before and after training, are in TensorBoard at their
    steps; --help lists the shared flags and exits 0."""
    workdir = tmp_path / "work"
    out = _run("train_lm.py", "--max_steps=4", f"--workdir={workdir}", "--mesh=-1,1,2", *TINY_LM)
    console = out.stderr.splitlines()
    assert len(console) <= 8, out.stderr
    assert not any(word in out.stderr for word in ("orbax", "checkpoint_manager", "xla_bridge", "embed/embedding"))
    log = (workdir / "log.txt").read_text()
    assert "checkpoint_manager" in log and "embed/embedding" in log
    before, after = _eval_losses(out.stdout)
    evals = _scalars(workdir / "tensorboard")["eval/loss"]
    assert (0, pytest.approx(before, abs=1e-4)) in evals and (4, pytest.approx(after, abs=1e-4)) in evals, evals

    helped = _run("train_lm.py", "--help")
    for flag in ("--mesh", "--max_steps", "--workdir", "--data", "--init_from"):
        assert flag in helped.stdout, flag


def test_a_run_stopped_by_a_signal_exits_128_plus_it_with_its_checkpoint(tmp_path):
    """SIGTERM during training: the checkpoint of the step it stopped at is saved and the exit status is 143, so a
    scheduler tells a preempted run from a finished one (the resume itself: tests/test_trainer.py); the goodput
    scalars written as it stopped are in its TensorBoard file."""
    import signal
    args = ["scripts/train_lm.py", "--max_steps=1000", f"--workdir={tmp_path}", *TINY_LM[:-2], "--save_every=1000",
            "--prompts=", TINY_LM[-1]]
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if re.search(r"\] step +\d+/1000", line):
            proc.send_signal(signal.SIGTERM)
            break
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stdout
    step = int(re.search(r"stopped by a signal at step (\d+)", stdout).group(1))
    assert _steps(tmp_path) == [step]
    # the scalars written as it stopped reach the event file (the script ends with os._exit)
    assert [s for s, _ in _scalars(tmp_path / "tensorboard")["goodput/fraction"]] == [step]


def test_a_diverged_run_ends_with_one_line_and_status_1_before_any_poisoned_checkpoint(tmp_path):
    out = _run("train_lm.py", "--learning_rate=1e9", "--max_steps=20", "--log_every=2", "--save_every=4",
               f"--workdir={tmp_path}", *TINY_LM[:3], TINY_LM[-1], "--prompts=", ok=False)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 1 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "non-finite loss or gradient at step" in errors[0]
    assert not (tmp_path / "checkpoints").exists() or _steps(tmp_path) == []


def test_a_full_disk_ends_with_one_line_and_status_1(tmp_path):
    """A 3 MB file system fills at the first checkpoint: Orbax's writer threads' errors are one line each on the
    console (their tracebacks in the log file only) and the run ends with one `error: disk full` line."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3M", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        out = _run("train_lm.py", "--max_steps=40", "--log_every=5", "--save_every=5", f"--workdir={small / 'w'}",
                   *TINY_LM[:2], "--prompts=", '--model_overrides={"hidden_size": 128, "intermediate_size": 256}',
                   ok=False)
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 1 and "Traceback" not in out.stderr and len(out.stderr.splitlines()) < 30, out.stderr
    assert len(errors) == 1 and errors[0].startswith("error: disk full: writing "), errors


@pytest.mark.slow  # CI time (three script runs, 20 s); the check itself: tests/test_text_and_scripts.py
def test_a_resume_on_other_data_is_refused_unless_continued(tmp_path):
    """run.json records a digest of the rows a run trains on (`run_record.data_digest`): a re-run whose files grew
    is refused in one line before it trains (its eval rows and the epoch's order would change), and
    --data_change=continue trains on from the checkpoint's step, saying so."""
    workdir, data = tmp_path / "work", tmp_path / "data"
    args = [f"--data={_stdlib_txt(data / 'a.txt').parent}/*.txt", "--tokenizer=byte", f"--workdir={workdir}",
            "--mesh=-1,1,1", "--prompts=", *TINY_LM]
    _run("train_lm.py", "--max_steps=2", *args)
    assert json.loads((workdir / "run.json").read_text())["training"]["data"]["about"] == "364 rows of 33 tokens"
    (data / "b.txt").write_text(" ".join(text_data.TOY_WORDS) * 20)
    grown = _run("train_lm.py", "--max_steps=3", *args, ok=False)
    assert grown.returncode == 2 and "eval loss" not in grown.stdout, grown.stdout[-2000:]
    assert re.search(r"^error: --data=.*/\*.txt \(--seq_len=32\) is not the data the run in .*work trained on "
                     r"\(then 364 rows of 33 tokens, now 402 rows of 33 tokens\): its eval rows", grown.stderr,
                     re.M), grown.stderr[-2000:]
    cont = _run("train_lm.py", "--max_steps=3", "--data_change=continue", *args)
    assert "--data_change=continue: it trains on from step 2 on this data" in cont.stderr, cont.stderr[-2000:]
    assert "resumed from" in cont.stdout and _steps(workdir)[-1] == 3


@pytest.mark.slow
def test_a_resumed_run_says_that_its_compute_dtype_or_fp8_changed(tmp_path):
    """The numerics' flags join the optimisation's in run.json: a resume under another --compute_dtype (as it
    resolves: unset is float32 on CPU, so naming float32 changes nothing) or --fp8 continues and says so."""
    workdir = tmp_path / "work"
    args = [f"--data={_stdlib_txt(tmp_path / 'data' / 'a.txt').parent}/*.txt", "--tokenizer=byte",
            f"--workdir={workdir}", "--mesh=-1,1,1", "--prompts=", *TINY_LM]
    _run("train_lm.py", "--max_steps=2", *args)
    assert json.loads((workdir / "run.json").read_text())["training"]["compute_dtype"] == "float32"
    same = _run("train_lm.py", "--max_steps=3", "--compute_dtype=float32", *args)
    assert "where the run in" not in same.stderr, same.stderr
    again = _run("train_lm.py", "--max_steps=4", "--compute_dtype=bfloat16", "--fp8", *args)
    assert f"--compute_dtype=bfloat16 where the run in {workdir} had float32" in again.stderr, again.stderr
    assert f"--fp8=True where the run in {workdir} had False" in again.stderr
    assert _steps(workdir)[-1] == 4


@pytest.mark.slow  # CI time (nine script runs, about 70 s); train_lm's own resume checks run by default
def test_record_scripts_keep_their_global_batch_data_and_ppo_iterations_on_resume(tmp_path):
    """What train_lm's run.json records, the record scripts' record too: the global batch (a restart on another
    device count accumulates micro-batches to keep it), a digest of the records (a re-run on grown data refused in
    one line, --data_change=continue trains on), the step of the --init_from run DPO's reference came from (a resume
    after it trained further refused), and PPO / GRPO's iteration (another --rollout_batch_size refused: the
    iteration a step is in would change)."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in preference.toy_prompt_responses(80, 0)))
    sft = tmp_path / "sft"
    args = [f"--workdir={sft}", f"--data={data}", "--tokenizer=word", "--eval_size=16", "--seq_len=24",
            "--eval_answers=0", "--log_every=2", "--save_every=2", "--per_device_batch_size=1", "--mesh=-1,1,1"]
    _run("train_sft.py", "--max_steps=2", *args)
    record = json.loads((sft / "run.json").read_text())["training"]
    assert record["global_batch"] == 8 and record["data"]["about"] == "64 rows of 25 tokens and 16 held out", record
    four = _run("train_sft.py", "--max_steps=4", *args, env={**ENV, "XLA_FLAGS": cpu_devices(4)})
    assert "--accumulate_grad_batches=2 keeps it on this mesh (4 rows a step)" in four.stderr, four.stderr[-2000:]
    dpo = [f"--init_from={sft}", f"--workdir={tmp_path / 'dpo'}", "--toy_size=64", "--eval_size=16", "--seq_len=24",
           "--per_device_batch_size=1", "--mesh=-1,1,1"]
    _run("train_dpo.py", "--max_steps=2", *dpo)  # its reference: the SFT run's step 4
    beta = _run("train_dpo.py", "--max_steps=3", "--beta=0.25", *dpo)
    assert re.search(r"--beta=0.25 where the run in .*dpo had 0.1: the resumed run continues under the new value",
                     beta.stderr), beta.stderr[-2000:]
    with open(data, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in preference.toy_prompt_responses(8, 1))
    grown = _run("train_sft.py", "--max_steps=6", *args, ok=False)
    assert grown.returncode == 2 and re.search(
        r"^error: --data=.*pairs.jsonl \(--seq_len=24\) is not the data the run in .*sft trained on \(then 64 rows "
        r"of 25 tokens and 16 held out, now 72 rows of 25 tokens and 16 held out\)", grown.stderr, re.M), \
        grown.stderr[-2000:]
    cont = _run("train_sft.py", "--max_steps=6", "--data_change=continue", *args)
    assert "--data_change=continue: it trains on from step 4 on this data" in cont.stderr and _steps(sft)[-1] == 6
    moved = _run("train_dpo.py", "--max_steps=4", *dpo, ok=False)
    assert moved.returncode == 2 and re.search(
        r"^error: --init_from=.*sft holds step 6, but the run in .*dpo took its reference from its step 4: the "
        r"reference would differ", moved.stderr, re.M), moved.stderr[-2000:]

    grpo = [f"--init_from={sft}", "--advantage_estimator=grpo", "--samples_per_prompt=2",
            "--verifiable_reward=exact_match", f"--data={data}", "--eval_size=16", "--max_new_tokens=4",
            "--eval_answers=0", "--per_device_batch_size=1", "--mesh=-1,1,1", f"--workdir={tmp_path / 'grpo'}"]
    _run("train_ppo.py", "--max_steps=2", "--ppo_epochs=1", "--rollout_batch_size=16", *grpo)
    other = _run("train_ppo.py", "--max_steps=4", "--ppo_epochs=1", "--rollout_batch_size=32", *grpo, ok=False)
    assert other.returncode == 2 and re.search(
        r"^error: --rollout_batch_size=32 \(as this run resolves it\) where the run in .*grpo had 16: an iteration's "
        r"rollouts and updates, and "
        r"which iteration a step is in, would change mid-run; expected --rollout_batch_size=16", other.stderr,
        re.M), other.stderr[-2000:]
