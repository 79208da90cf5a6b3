"""Multi-tier checkpoints (engine/checkpoint_tiers.py): local saves beside the workdir's, a restart from the newest
complete copy of either tier, ending bit for bit where the uninterrupted run ends; a lost, corrupt or other-mesh
local copy falls back to the persistent tier."""
import os
import shutil
import threading

import jax
import numpy as np
import optax
import pytest

import engine
from engine import checkpoint_tiers
from engine.checkpoint import StateMismatchError
from engine.checkpoint_tiers import LocalCheckpoints
from tests import trainer_task as task

EXAMPLES = task.make_examples(64)  # 8 updates an epoch at 8 rows


class _Crash(Exception):
    pass


class _CrashesAt:
    """EXAMPLES that raise at the `reads`-th read: a process dying between two saves."""

    def __init__(self, reads):
        self.reads, self.count = reads, 0

    def __len__(self):
        return len(EXAMPLES)

    def __getitem__(self, i):
        self.count += 1
        if self.count == self.reads:
            raise _Crash("killed")
        return EXAMPLES[i]


def _trainer(tmp_path, mesh=None, local="local", **kwargs):
    checkpointing = engine.Checkpointing(local_dir=str(tmp_path / local), local_every=2) if local else None
    return engine.Trainer(mesh=mesh or engine.make_mesh(data=4, model=2), params=task.init_params(),
                          optimizer=optax.adam(1e-2), loss_fn=task.loss_fn, collate_fn=task.collate_fn,
                          workdir=str(tmp_path / "work"), checkpointing=checkpointing or engine.Checkpointing(),
                          **kwargs)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """A run that trained until the first read of the 8th batch failed (while or after step 7 trained): persistent
    saves at step 5, local ones at 2, 4 and 6."""
    path = tmp_path_factory.mktemp("crashed")
    run = _trainer(path)
    with pytest.raises(_Crash):
        run.fit(_CrashesAt(7 * 8 + 1), per_device_batch_size=2, n_epochs=2, save_every=5)
    run.close()
    assert run.step == 7
    return path


def _crashed_run(tmp_path, crashed):
    """A copy of the crashed run under tmp_path (the local tier's directory is named after the workdir's path)."""
    shutil.copytree(crashed / "work", tmp_path / "work")
    source = LocalCheckpoints(str(crashed / "local"), str(crashed / "work")).directory
    shutil.copytree(source, LocalCheckpoints(str(tmp_path / "local"), str(tmp_path / "work")).directory,
                    dirs_exist_ok=True)


@pytest.fixture(scope="module")
def whole():
    run = engine.Trainer(mesh=engine.make_mesh(data=4, model=2), params=task.init_params(),
                         optimizer=optax.adam(1e-2), loss_fn=task.loss_fn, collate_fn=task.collate_fn)
    run.fit(EXAMPLES, per_device_batch_size=2, n_epochs=2)
    return jax.device_get(run.params), run.step


def _ends_as(run, whole):
    params, step = whole
    run.fit(EXAMPLES, per_device_batch_size=2, n_epochs=2, save_every=5)
    assert run.step == step
    for a, b in zip(jax.tree.leaves(jax.device_get(run.params)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)  # bit for bit
    run.close()


def test_a_restart_restores_the_newest_local_copy_and_ends_where_the_uninterrupted_run_ends(tmp_path, crashed, whole):
    _crashed_run(tmp_path, crashed)
    local = LocalCheckpoints(str(tmp_path / "local"), str(tmp_path / "work"))
    assert local.steps() == [6]  # keep 1: the older local steps are gone
    assert sorted(int(n) for n in os.listdir(tmp_path / "work" / "checkpoints") if n.isdigit()) == [5]
    rerun = _trainer(tmp_path)
    assert rerun.step == 6
    _ends_as(rerun, whole)


def test_a_lost_local_copy_falls_back_to_the_persistent_checkpoint(tmp_path, crashed, whole):
    _crashed_run(tmp_path, crashed)
    local = LocalCheckpoints(str(tmp_path / "local"), str(tmp_path / "work"))
    local.remove(6)  # the host's local disk was wiped
    rerun = _trainer(tmp_path)
    assert rerun.step == 5
    _ends_as(rerun, whole)


def test_a_corrupt_local_copy_is_dropped_and_the_persistent_one_restores(tmp_path, crashed, whole, caplog):
    _crashed_run(tmp_path, crashed)
    local = LocalCheckpoints(str(tmp_path / "local"), str(tmp_path / "work"))
    path = os.path.join(local.directory, "6", "blocks.bin")
    with open(path, "r+b") as f:  # one bit flipped in the middle of the saved state
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    rerun = _trainer(tmp_path)
    assert rerun.step == 5
    assert "skipping the local copy of step 6" in caplog.text and "does not match its checksum" in caplog.text
    assert local.steps() == []  # a cache of the run: dropped, not kept for inspection
    _ends_as(rerun, whole)


def test_a_local_copy_of_another_mesh_is_skipped_and_kept(tmp_path, crashed):
    _crashed_run(tmp_path, crashed)
    other = _trainer(tmp_path, mesh=engine.make_mesh(data=2, fsdp=2, model=2))  # an elastic restart
    assert other.step == 5  # the persistent tier restores onto any mesh
    other.close()
    assert LocalCheckpoints(str(tmp_path / "local"), str(tmp_path / "work")).steps() == [6]
    again = _trainer(tmp_path)  # back on the mesh that wrote it
    assert again.step == 6
    again.close()


def test_a_state_of_other_leaves_is_refused_and_every_copy_kept(tmp_path, crashed):
    """A restart under another optimizer is refused in one line (checkpoint.StateMismatchError) without deleting
    the local copy it cannot read into that state, nor moving the persistent step aside; with params_only the local
    copy gives it the parameters."""
    _crashed_run(tmp_path, crashed)
    with pytest.raises(StateMismatchError, match=r"^step 6 of .* holds another training state than this run's"):
        engine.Trainer(mesh=engine.make_mesh(data=4, model=2), params=task.init_params(),
                       optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
                       loss_fn=task.loss_fn, collate_fn=task.collate_fn, workdir=str(tmp_path / "work"),
                       checkpointing=engine.Checkpointing(local_dir=str(tmp_path / "local"), local_every=2))
    assert LocalCheckpoints(str(tmp_path / "local"), str(tmp_path / "work")).steps() == [6]
    fresh = engine.Trainer(mesh=engine.make_mesh(data=4, model=2), params=task.init_params(),
                           optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
                           loss_fn=task.loss_fn, collate_fn=task.collate_fn, workdir=str(tmp_path / "work"),
                           checkpointing=engine.Checkpointing(local_dir=str(tmp_path / "local"), local_every=2,
                                                              params_only=True))
    assert fresh.step == 6  # its parameters only, from the local copy, with the new optimizer's fresh state
    fresh.close()
    again = _trainer(tmp_path)
    assert again.step == 6
    again.close()


def test_a_payload_crosses_in_chunks_to_the_next_process(monkeypatch):
    """`_send`, the replicas' transport (one process: to itself), over several chunks and a part of one; a
    `_Transfer` launches `count` chunks a call, never more than `_WINDOW` of them unread."""
    monkeypatch.setattr(checkpoint_tiers, "_CHUNK", 1024)
    monkeypatch.setattr(checkpoint_tiers, "_WINDOW", 2)
    payload = np.random.RandomState(0).randint(0, 256, 5000).astype(np.uint8)
    for offset in (-1, 1):
        np.testing.assert_array_equal(checkpoint_tiers._send(payload, offset), payload)
    assert checkpoint_tiers._send(np.zeros(0, np.uint8), 1).size == 0
    transfer = checkpoint_tiers._Transfer(payload, -1)
    in_flight = lambda: sum(out is not None for out in transfer.outputs)  # noqa: E731
    assert not transfer.launch(2) and len(transfer.outputs) == 2 and in_flight() == 2
    assert not transfer.launch(2) and len(transfer.outputs) == 4 and in_flight() == 2  # it read what the window needs
    assert transfer.launch() and len(transfer.outputs) == 5 and in_flight() <= 2
    np.testing.assert_array_equal(transfer.result(), payload)


def _replicated_locally(tmp_path):
    """LocalCheckpoints of one process that keeps a replica of its own blocks, as process p keeps p + 1's."""
    local = LocalCheckpoints(str(tmp_path / "local"), str(tmp_path / "work"))
    local.replica, local.replicas = checkpoint_tiers._Steps(os.path.join(local.directory, "..", "replica"), 1), 1
    return local


def _sharded_state():
    mesh = engine.make_mesh(data=4, model=2)
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return {"w": jax.device_put(np.arange(64 * 8, dtype=np.float32).reshape(64, 8), split),
            "b": jax.device_put(np.arange(5, dtype=np.int32), whole)}


def test_a_save_returns_before_its_replica_arrives_and_the_replica_restores(tmp_path, monkeypatch):
    """The replica's transfer is off the save's critical path: with its bytes held back (`_fetch` waits for the
    test), the save returns and no replica exists yet; the saving thread never waits for them. Once they arrive the
    replica is written, and a local copy written back from it restores bit for bit."""
    release, fetches = threading.Event(), []
    fetch = checkpoint_tiers._fetch

    def held(array):
        on_main = threading.current_thread() is threading.main_thread()
        fetches.append((on_main, release.is_set()))
        if not on_main:
            release.wait(timeout=120)  # a safety net for a failing test, not a timing
        return fetch(array)
    monkeypatch.setattr(checkpoint_tiers, "_fetch", held)
    local, state = _replicated_locally(tmp_path), _sharded_state()
    local.save(3, state, {"step": 3})
    assert local.replica.steps() == []  # the bytes have not arrived, and nothing passes as a replica
    assert (True, False) not in fetches  # the saving thread did not wait for them
    release.set()
    local.wait()
    assert local.replica.steps() == [3] and local.steps() == [3]
    payload = local.replica.files(3)  # what the peer would send back to a process that lost its copy
    local.remove(3)
    local.put_files(3, payload)
    assert local.read_meta(3)["step"] == 3
    for a, b in zip(jax.tree.leaves(local.restore(3, state)), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == b.sharding


def test_a_transfer_that_fails_midway_leaves_no_replica(tmp_path, monkeypatch):
    """A chunk that never arrives (a peer lost mid-transfer): the own copy is written, no replica step (complete or
    not) is, the next `wait` raises in one line, and the next save writes both again."""
    monkeypatch.setattr(checkpoint_tiers, "_CHUNK", 1024)
    fetch, calls = checkpoint_tiers._fetch, []

    def fails_second(array):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("peer lost")
        return fetch(array)
    monkeypatch.setattr(checkpoint_tiers, "_fetch", fails_second)
    local, state = _replicated_locally(tmp_path), _sharded_state()
    local.save(3, state, {"step": 3})
    with pytest.raises(OSError, match="failed to write: peer lost"):
        local.wait()
    assert local.steps() == [3] and not os.path.exists(local.replica.directory)  # not even a partial step
    local.save(4, state, {"step": 4})
    local.wait()
    assert local.steps() == [4] and local.replica.steps() == [4]


def test_a_local_step_written_back_from_its_replica_restores_and_ends_as_the_uninterrupted_run(tmp_path, crashed,
                                                                                                 whole):
    """What a peer holding a replica sends (`files`) and the process that lost its copy writes back (`put_files`):
    the same files, every checksum verified before sending; a replica that fails its checksums is refused."""
    _crashed_run(tmp_path, crashed)
    local = LocalCheckpoints(str(tmp_path / "local"), str(tmp_path / "work"))
    step = os.path.join(local.directory, "6")
    files = {name: open(os.path.join(step, name), "rb").read() for name in os.listdir(step)}
    payload = local.files(6)
    local.remove(6)  # this host's copy is gone; its peer sends the replica's bytes
    local.put_files(6, payload)
    assert {name: open(os.path.join(step, name), "rb").read() for name in os.listdir(step)} == files
    replica = checkpoint_tiers._Steps(str(tmp_path / "replica"), keep=1)
    replica.put_files(6, payload)
    with open(os.path.join(replica.directory, "6", "blocks.bin"), "r+b") as f:  # one bit flipped in the last block
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ValueError, match="does not match its checksum"):
        replica.files(6)
    rerun = _trainer(tmp_path)
    assert rerun.step == 6
    _ends_as(rerun, whole)


def test_checkpointing_refuses_bad_local_settings():
    with pytest.raises(ValueError, match=r"Checkpointing.local_dir.*None or a directory path"):
        engine.Checkpointing(local_dir="")
    with pytest.raises(ValueError, match=r"Checkpointing.local_every.*an integer >= 1"):
        engine.Checkpointing(local_dir="/tmp/x", local_every=0)
    with pytest.raises(ValueError, match=r"Checkpointing.local_replicas=2; expected 0 or 1"):
        engine.Checkpointing(local_dir="/tmp/x", local_replicas=2)
