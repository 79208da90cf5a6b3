"""Multi-host start-up through JAX's own distributed runtime (NCCL on GPU, the TPU interconnect, gloo on CPU)."""
import math
import os
import re
import socket
import threading
import time

import jax
from absl import logging

_ENV = ("ENGINE_COORDINATOR_ADDRESS", "ENGINE_NUM_PROCESSES", "ENGINE_PROCESS_ID")


def _from_slurm():
    """(coordinator, num_processes, process_id) from SLURM's variables, or None outside a multi-task SLURM step."""
    n = int(os.environ.get("SLURM_NTASKS", "1"))
    if n <= 1 or "SLURM_PROCID" not in os.environ:
        return None
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
    head = _first_slurm_host(nodes)
    port = os.environ.get("ENGINE_COORDINATOR_PORT", str(12000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))
    return f"{head}:{port}", n, int(os.environ["SLURM_PROCID"])


def _first_slurm_host(nodelist):
    """First host of a SLURM node list such as 'gpu[003-005,007],cpu1' -> 'gpu003'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        raise ValueError(f"initialize_distributed: cannot parse SLURM node list {nodelist!r}")
    prefix, ranges = m.groups()
    return prefix + (re.split(r"[,-]", ranges)[0] if ranges else "")


class DistributedError(RuntimeError):
    """The multi-process runtime could not form or lost a process; the message names what happened."""


def _resolve(address):
    """Fails at once when the coordinator's host name does not resolve (jax would wait its whole timeout)."""
    host, _, port = address.rpartition(":")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port))
    except (socket.gaierror, ValueError) as e:
        raise ValueError(f"initialize_distributed: coordinator_address={address!r}: host {host!r} does not resolve "
                         f"({e}); expected a host name or address every process can reach") from None


def _check_reachable(address, timeout_s):
    """Fails fast when the coordinator does not answer: jax would otherwise wait `initialization_timeout`."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=min(2.0, timeout_s)):
                return
        except OSError as e:
            last = e
            time.sleep(0.2)
    raise DistributedError(f"initialize_distributed: coordinator {address} did not answer within {timeout_s} s "
                           f"({last}); is process 0 running with the same --coordinator_address?")


def initialize_distributed(coordinator_address=None, num_processes=None, process_id=None, local_device_ids=None,
                           *, timeout_s=300, heartbeat_timeout_s=100):
    """Joins this process to a multi-process JAX runtime; returns `(process_id, num_processes)`.

    Sources, in order: the explicit arguments; else `ENGINE_COORDINATOR_ADDRESS` / `ENGINE_NUM_PROCESSES` /
    `ENGINE_PROCESS_ID`; else SLURM's variables; else nothing to do (one process). On CPU the gloo collectives are
    selected so that several processes on one machine form one runtime.

    Failures are bounded and named: a coordinator host that does not resolve is a ValueError at once; a coordinator
    that does not answer, or processes that do not all join, within `timeout_s` seconds raise `DistributedError`
    (a RuntimeError) saying which. `heartbeat_timeout_s` bounds how long a lost process (killed, its host gone) goes
    unnoticed once running; then the runtime ends every process (XLA's distributed client aborts).
    """
    if coordinator_address is None and num_processes is None and process_id is None:
        env = [os.environ.get(k) for k in _ENV]
        if all(env):
            coordinator_address, num_processes, process_id = env[0], int(env[1]), int(env[2])
        elif any(env):
            missing = [k for k, v in zip(_ENV, env) if not v]
            raise ValueError(f"initialize_distributed: {', '.join(missing)} not set; expected all of {', '.join(_ENV)}")
        elif (slurm := _from_slurm()) is not None:
            coordinator_address, num_processes, process_id = slurm
    if coordinator_address is None and num_processes is None and process_id is None:
        return 0, 1
    if coordinator_address is None or ":" not in str(coordinator_address):
        raise ValueError(f"initialize_distributed: coordinator_address={coordinator_address!r}; expected 'host:port'")
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"initialize_distributed: num_processes={num_processes!r}; expected a positive integer")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"initialize_distributed: process_id={process_id!r}; expected 0 <= process_id < {num_processes}")
    if num_processes == 1:
        return 0, 1
    for name, value in (("timeout_s", timeout_s), ("heartbeat_timeout_s", heartbeat_timeout_s)):
        if not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"initialize_distributed: {name}={value!r}; expected a positive number of seconds")
    _resolve(coordinator_address)
    # Only affects the CPU backend; lets processes on one machine (or CPU hosts) run cross-process collectives.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if process_id != 0:  # process 0 hosts the coordinator itself
        _check_reachable(coordinator_address, timeout_s)
    logging.info("initialize_distributed: process %d of %d, coordinator %s", process_id, num_processes,
                 coordinator_address)
    who = (f"process 0 (the coordinator at {coordinator_address}): not all {num_processes} processes joined"
           if process_id == 0 else f"process {process_id} could not join the coordinator at {coordinator_address}")
    message = (f"initialize_distributed: {who} within {timeout_s} s; start every process with the same coordinator "
               f"address and num_processes={num_processes}")
    # XLA's client aborts the process (a C++ fatal error and its stack) when the processes do not all join in time;
    # this watchdog ends it a little earlier with a line that says what happened.
    watchdog = threading.Timer(timeout_s, _end, (message,))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                   process_id=process_id, local_device_ids=local_device_ids,
                                   initialization_timeout=int(math.ceil(timeout_s)) + _ABORT_GRACE_S,
                                   heartbeat_timeout_seconds=int(math.ceil(heartbeat_timeout_s)))
    except Exception as e:  # noqa: BLE001 - XLA's runtime errors have no narrower public type
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(f"{message} ({first})") from None
    finally:
        watchdog.cancel()
    return jax.process_index(), jax.process_count()


# Seconds XLA's own join timeout runs past the watchdog's.
_ABORT_GRACE_S = 5


def _end(message):
    logging.error("%s", message)
    logging.flush()
    os._exit(1)
