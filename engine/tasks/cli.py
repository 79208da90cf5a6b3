"""The scripts' process: `run(main)`, their entry point, which turns a bad flag or bad input into a one-line `error:`
and exit code 2 instead of a traceback and keeps the console to the project's own lines (everything in the workdir's
log file); `start` (the multi-process runtime, the flag checks, the mesh) and the end of a training script
(`progress_lines`, `log_eval`). The flags are `script_flags`'s. Scripts import this module; tests can too."""
import atexit
import errno
import logging as std_logging
import os
import re
import sys
import threading
import traceback

import jax
from absl import app, flags, logging

import engine
from engine import compiler, distributed, fit_loop
from engine.tasks import run_record, script_flags

FLAGS = flags.FLAGS


# User-input errors: reported in one line. Anything else (a bug) keeps its traceback.
_USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, app.UsageError, flags.Error)
USAGE_EXIT_CODE = 2
# The exit status of a run that failed at run time (diverged, disk full): not a usage error.
RUNTIME_EXIT_CODE = 1


def start(auto=False):
    """Joins the multi-process runtime (if asked) and builds the mesh from the flags. auto: the script takes
    --mesh=auto (then None is returned and the script calls `mesh_choice.choose_mesh` once its model is described)."""
    if auto and FLAGS.mesh_memory_gb is not None and (FLAGS.mesh != "auto" or FLAGS.mesh_memory_gb <= 0):
        raise ValueError(f"--mesh_memory_gb={FLAGS.mesh_memory_gb} with --mesh={FLAGS.mesh}; expected a positive "
                         "budget with --mesh=auto")
    for name in ("per_device_batch_size", "accumulate_grad_batches", "pipeline_stages", "context_parallel"):
        if FLAGS[name].value < 1:
            raise ValueError(f"--{name}={FLAGS[name].value}; expected an integer >= 1")
    engine.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                                  timeout_s=FLAGS.coordinator_timeout, heartbeat_timeout_s=FLAGS.peer_timeout)
    if jax.process_count() > 1 and FLAGS.verbosity < 1:
        _StdoutFilter.install()
    if "local_save_every" in FLAGS and FLAGS.local_save_every < 1:
        raise ValueError(f"--local_save_every={FLAGS.local_save_every}; expected an integer >= 1")
    if FLAGS.pipeline_microbatches < 0:
        raise ValueError(f"--pipeline_microbatches={FLAGS.pipeline_microbatches}; expected an integer >= 0")
    script_flags.check_diloco_flags()
    if "save_best" in FLAGS:
        script_flags.fit_kwargs()  # bad --eval_every / --save_best fail before any model is built
    if "lr_schedule" in FLAGS:
        script_flags.check_optimizer_flags()
    # A training script (its loop flags: --max_steps) keeps its run's global batch; generate.py and export_hf.py
    # read a workdir with whatever batch they like.
    elastic = "workdir" in FLAGS and "max_steps" in FLAGS
    if FLAGS.mesh == "auto":
        if not auto:
            raise ValueError("--mesh=auto; expected integers data,fsdp,model[,expert] such as 2,2,2 (this script does "
                             f"not choose a layout: {script_flags.AUTO_MESH_SCRIPTS} do)")
        if elastic:  # every layout of these devices takes the same rows a step (mesh_choice.choose_mesh)
            positions = jax.device_count() // (FLAGS.pipeline_stages * FLAGS.context_parallel)
            run_record.keep_global_batch(FLAGS.workdir, FLAGS.per_device_batch_size * positions)
        return None
    mesh = engine.make_mesh(stage=FLAGS.pipeline_stages, context=FLAGS.context_parallel,
                            **script_flags.parse_mesh(FLAGS.mesh))
    if elastic:
        run_record.keep_global_batch(FLAGS.workdir, engine.global_batch_size(mesh, FLAGS.per_device_batch_size))
    if "zero_quantized_weights" in FLAGS:  # the training scripts': checked before any workdir file is written
        engine.step_program.check_zero_quantized(engine.step.Int8(FLAGS.zero_quantized_weights,
                                                                  FLAGS.zero_quantized_gradients),
                                                 mesh, diloco=bool(FLAGS.diloco_inner_steps))
    return mesh


def progress_lines(trainer, log_every):
    """The lines a training script prints after `fit`: one per `log_every` steps of the history (loss, and token
    accuracy when the loss reports it), one per eval, the best checkpoint kept (`--save_best`), then the throughput
    of the last logged steps."""
    lines = []
    for record in trainer.history:
        if "loss" in record and record["step"] % log_every == 0:
            accuracy = f"  token accuracy {record['accuracy']:.3f}" if "accuracy" in record else ""
            lines.append(f"step {record['step']:5d}  loss {record['loss']:.4f}{accuracy}")
        elif "eval_loss" in record:
            results = " | ".join(f"{k[len('eval_'):]} {v:.4f}" for k, v in record.items() if k != "step")
            lines.append(f"eval at step {record['step']}: {results}")
    if trainer.best is not None:
        best = trainer.best
        lines.append(f"best eval {best['metric']} {best['value']:.4f} at step {best['step']} "
                     f"(kept under {trainer.workdir}/best; --checkpoint=best reads it)")
    fig = trainer.throughput
    if fig:
        flops = ""
        if fig.get("model_tflops_per_device") is not None:
            mfu = f", MFU {100 * fig['mfu']:.1f}%" if fig.get("mfu") is not None else ""
            flops = f", {fig['model_tflops_per_device']:.3g} model TFLOP/s per device{mfu}"
        lines.append(f"throughput of the last logged steps: {fig['seconds_per_step']:.3f} s/step, "
                     f"{fig['examples_per_second']:.1f} examples/s{flops}")
    return lines


def log_eval(trainer, results):
    """Writes an eval the script prints (`{name: value}`, e.g. the losses before and after training) to TensorBoard
    as `eval/<name>` at the trainer's current step, so every eval on the console is also in TensorBoard."""
    trainer.write_scalars("eval", results)


# The project's code: INFO lines from anywhere else (Orbax, JAX) go to the workdir's log file only.
_PROJECT_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), d)
                      + os.sep for d in ("engine", "kernels", "models", "scripts"))


def _exit(code):
    # os._exit: background threads (prefetch, async checkpoints, the distributed client) must not keep a failed or
    # stopped run alive or print at shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    _StdoutFilter.close()
    os._exit(code)


class _StdoutFilter:
    """Gloo (XLA's CPU collectives) prints a `[Gloo] Rank ... is connected to ...` line on the C++ stdout for every
    communicator it opens, a dozen per process; no setting turns them off. In a multi-process run the process's
    stdout goes through a pipe whose reader drops those lines into the log file and passes every other byte on.
    `close` (at exit) drains the pipe before the process ends, so no output is lost."""
    _original, _thread = None, None

    @classmethod
    def install(cls):
        if cls._thread is not None:
            return
        sys.stdout.flush()
        cls._original = os.dup(1)
        read, write = os.pipe()
        os.dup2(write, 1)
        os.close(write)
        cls._thread = threading.Thread(target=cls._pump, args=(read, cls._original), daemon=True,
                                       name="stdout-filter")
        cls._thread.start()
        atexit.register(cls.close)

    @staticmethod
    def _pump(read, original):
        with os.fdopen(read, "rb") as lines:
            for line in lines:
                if line.startswith(b"[Gloo] "):
                    logging.info("%s", line.decode(errors="replace").rstrip(), extra={"console": False})
                else:
                    os.write(original, line)

    @classmethod
    def close(cls):
        if cls._thread is None:
            return
        sys.stdout.flush()
        os.dup2(cls._original, 1)  # the pipe's last writer goes: its reader sees the end once drained
        cls._thread.join(timeout=10)
        cls._thread = None


def _fail(error, code=USAGE_EXIT_CODE):
    message = " ".join(str(error).split()) or type(error).__name__
    logging.debug("error", exc_info=error)  # the traceback, with --verbosity=1
    print(f"error: {message}", file=sys.stderr, flush=True)
    _exit(code)


def _disk_full(error):
    """A full disk, as Python (ENOSPC, EDQUOT) or Orbax's writers (a ValueError quoting the OS error) report it."""
    return ((isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT))
            or "No space left on device" in str(error))


class _ConsoleFormatter(logging.PythonFormatter):
    """absl's format, without the tracebacks that libraries (Orbax's writer threads) attach to their error records:
    on the console those are one line each; the log file keeps the traceback."""

    def format(self, record):
        if record.exc_info is None or record.pathname.startswith(_PROJECT_DIRS) or FLAGS.verbosity >= 1:
            return super().format(record)
        exc_info, exc_text = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return super().format(record)
        finally:
            record.exc_info, record.exc_text = exc_info, exc_text


class _ConsoleFilter:
    """What reaches the console at the default verbosity: every warning and error, and the INFO lines of the
    project's own code (progress, evals, compile summary, where things were written) except those logged with
    `extra={"console": False}` (detail such as the parameter table). Libraries' INFO lines and the detail go to the
    workdir's log file; `--verbosity=1` shows everything."""

    @staticmethod
    def filter(record):
        if record.levelno >= std_logging.WARNING or FLAGS.verbosity >= 1:
            return True
        return record.pathname.startswith(_PROJECT_DIRS) and getattr(record, "console", True)


def _console_logging():
    """The console filter above and, for a training script, the whole log (every library, INFO and up) in
    `--workdir`'s `log.txt` (`log.process<i>.txt` for the further processes of a multi-process run)."""
    logging.get_absl_handler().addFilter(_ConsoleFilter)
    logging.get_absl_handler().setFormatter(_ConsoleFormatter())
    sys.unraisablehook = _unraisable
    if "save_every" not in FLAGS or not FLAGS.workdir:
        return
    process = FLAGS.process_id or int(os.environ.get("ENGINE_PROCESS_ID", os.environ.get("SLURM_PROCID", "0")))
    os.makedirs(FLAGS.workdir, exist_ok=True)
    name = "log.txt" if process == 0 else f"log.process{process}.txt"
    file_handler = _LogFile(os.path.join(FLAGS.workdir, name))
    file_handler.setFormatter(logging.PythonFormatter())
    std_logging.getLogger().addHandler(file_handler)


def _unraisable(unraisable):
    """Exceptions no caller can catch (raised in a callback, a finaliser) from libraries' code, such as the
    `RuntimeError: Event loop is closed` of tensorstore's callbacks that complete after a failed Orbax save closed its
    loop: a traceback each on the console at a race's whim. They go to the log file; the project's own still go to
    the console through Python's default hook."""
    frames = traceback.extract_tb(unraisable.exc_traceback) if unraisable.exc_traceback else []
    if any(frame.filename.startswith(_PROJECT_DIRS) for frame in frames):
        sys.__unraisablehook__(unraisable)
        return
    logging.info("%s: %s", unraisable.err_msg or "Exception ignored", unraisable.object, extra={"console": False},
                 exc_info=(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback))


class _LogFile(std_logging.FileHandler):
    """The workdir's log file. A write that fails (a full disk) stops it with one note on the console instead of
    logging's traceback for every later line."""
    failed = False

    def emit(self, record):
        if not self.failed:
            super().emit(record)

    def handleError(self, record):
        if not self.failed:
            self.failed = True
            error = sys.exc_info()[1]
            print(f"warning: stopped writing the log file {self.baseFilename}: {error}", file=sys.stderr, flush=True)


def _help(argv):
    """--help / -h: the script's own flags and the shared ones it uses (mesh, steps, workdir, ...); exit 0."""
    for flag in FLAGS.get_flags_for_module(script_flags.__name__):
        FLAGS.register_key_flag_for_module(argv[0], flag)
    print(FLAGS.module_help(argv[0]))
    print("\n--helpfull lists every flag, the libraries' included.")
    _exit(0)


def run(main):
    """`absl.app.run(main)` for scripts: a bad flag value, a missing or malformed file or any other bad input
    (ValueError, FileNotFoundError, app.UsageError, flags.Error) ends with one line `error: <message>` on stderr
    and exit code 2, never a traceback; a diverged run (FloatingPointError), a multi-process start that failed
    (DistributedError) or a full disk with one line and exit code 1; a run a signal stopped (`fit` saved, then
    raised `engine.StoppedBySignal`) with where to resume and 128 + the signal's number; a second signal with one
    line and 128 + its number. `--help` lists the script's flags (exit 0). The console shows the project's own
    lines; everything is in the workdir's log file."""
    def parse(argv):
        if any(a in ("--help", "-h", "-?", "--helpshort") for a in argv[1:]):
            _help(argv)
        try:
            return FLAGS(argv)
        except flags.Error as e:
            _fail(e)

    def guarded(argv):
        if len(argv) > 1:
            _fail(app.UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag (see --help)"))
        _console_logging()
        compiler.configure()  # the overlap flags, before anything in `main` starts JAX's backend
        try:
            if "compilation_cache_dir" in FLAGS:  # before the first compile
                try:
                    compiler.use_compilation_cache(FLAGS.compilation_cache_dir)
                except ValueError as e:
                    raise ValueError(f"--compilation_cache_dir={FLAGS.compilation_cache_dir}: {e}") from None
            return main(argv)
        except Exception as e:  # noqa: BLE001 - sorted below; anything else re-raised with its traceback
            if _disk_full(e):
                where = re.search(r'"(/[^"]+)"', str(e))
                _fail(f"disk full: {'writing ' + where.group(1) + ': ' if where else ''}no space left on the device; "
                      "the checkpoints finished earlier are kept", RUNTIME_EXIT_CODE)
            if isinstance(e, _USER_ERRORS):
                _fail(e)
            if isinstance(e, (FloatingPointError, distributed.DistributedError)):
                _fail(e, RUNTIME_EXIT_CODE)
            raise
        except fit_loop.StoppedBySignal as e:  # fit saved; 143 for SIGTERM, 130 for Ctrl-C, as a shell reports
            workdir = FLAGS["workdir"].value if "workdir" in FLAGS else None
            saved = (f"checkpoint saved in {workdir}; re-run to resume" if e.saved else
                     f"its checkpoint in {workdir} stays; re-run to resume" if e.step else "nothing trained yet")
            print(f"stopped by a signal at step {e.step}; {saved}", flush=True)
            _exit(e.code)
        except fit_loop.SecondSignal as e:
            print(f"stopped: {e}; the last finished checkpoint stays", file=sys.stderr, flush=True)
            _exit(128 + e.signum)

    app.run(guarded, flags_parser=parse)
