"""One run per workdir: `hold(workdir)` takes an exclusive lock on `workdir/.lock` for this process (process 0 of a
multi-process run takes it, the others agree on its answer), so that a run started on a workdir another run is using
is refused in one line instead of both writing checkpoints there (seen: the second run's save died on a step the
first was still writing). The lock is the operating system's (`fcntl.flock`), so a run that dies, `kill -9` included,
releases it. Trainers of one process on one workdir share it (counted); `release` drops one hold. On a filesystem
without locks (some network mounts) the run goes on unlocked, with a warning."""
import errno
import fcntl
import os
import socket
import threading

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

LOCK_FILE = ".lock"
_held = {}  # the lock file's absolute path -> [file descriptor or None (unlocked filesystem), holds]
_mutex = threading.Lock()


def hold(workdir):
    """Takes (or, in a process already holding it, shares) `workdir`'s lock; ValueError in one line, on every
    process of the run, when another run holds it."""
    path = os.path.join(os.path.abspath(workdir), LOCK_FILE)
    holder = _acquire(path) if jax.process_index() == 0 else None  # None: ours now; else who holds it
    taken = holder is not None
    if jax.process_count() > 1:
        taken = bool(multihost_utils.broadcast_one_to_all(np.int32(taken)))
    if taken:
        raise ValueError(f"workdir={workdir} is in use by another run ({holder or 'its process 0 found the lock taken'}"
                         f", {path}); expected one run per workdir: wait for that run to end, or use another workdir")


def release(workdir):
    """Drops one hold of `workdir`'s lock; the last one unlocks it."""
    path = os.path.join(os.path.abspath(workdir), LOCK_FILE)
    with _mutex:
        entry = _held.get(path)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _held[path]
            if entry[0] is not None:
                fcntl.flock(entry[0], fcntl.LOCK_UN)
                os.close(entry[0])


def _acquire(path):
    """None when this process holds `path`'s lock (now or already), else a description of the holder."""
    with _mutex:
        if path in _held:
            _held[path][1] += 1
            return None
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                holder = os.read(fd, 256).decode(errors="replace").strip()
                os.close(fd)
                return f"process {holder}" if holder else "a process that has not yet named itself"
            os.close(fd)
            logging.warning("workdir lock %s: %s; this run goes on without refusing a second one there", path, e)
            fd = None
        if fd is not None:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} on {socket.gethostname()}".encode())
        _held[path] = [fd, 1]
        return None
