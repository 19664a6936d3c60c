"""The worker pool of ``xprep tokenize``: a Processor mapped over record batches in input order, in a thread beside
the reading one or over worker processes (forked where that is safe, else spawned), with bounded lookahead.

Results come back from a worker process through files (``Spilled``); a worker that dies ends the command in one
line, and each worker ends with the command however it ends (``xprep.prep.lifeline``).
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import warnings
from collections import deque
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass

from xprep.prep.chat import abort_renders, adopt_verdicts, render_watchdog_running, verdicts
from xprep.prep.errors import XprepError, machine_errors
from xprep.prep.lifeline import die_with_parent
from xprep.prep.sources import RawBatch, Unreadable
from xprep.prep.tokenize.encode import Encoded, Processor

CHAT_POOL_MIN_BYTES = 16 << 20  # below this much chat input, starting more workers costs more than they save
# a worker process's own (and, until its workers are gone, the one a process forked them with)
_PROCESSOR: Processor | None = None
_START_ERROR: XprepError | None = None


def _start_pool(make: Callable[..., Processor], args: tuple, workers: int, start: str) -> ProcessPoolExecutor:
    """``workers`` processes, each with a Processor (``make(*args)``): forked from this process once it has built one,
    where that is safe and ``start`` (``--worker-start``) is fork; else spawned, each building its own.

    A forked worker starts with the tokenizer loaded, the template checked and the modules imported, where a
    spawned one pays ~0.9 CPU-s for them (50 MB of chat on 2 cores: 3.5–3.9 CPU-s in all spawned, 2.6–2.8
    forked; 2.27–2.51 s and 2.09–2.33 s). Forking is safe where no other thread of this process can hold a
    lock: on Linux (fork is unsafe on macOS, absent on Windows), with this thread the only Python thread, so
    before the writer's thread starts. The native pools alive by then are idle and prepared for fork: OpenBLAS
    (numpy), and pyarrow's thread pool and jemalloc (pyarrow re-creates its pools in a child). A forked worker
    leaves without Python's teardown (multiprocessing ends it with ``os._exit``), so the file buffers it
    inherited are never flushed twice. ``--worker-start spawn`` forces spawning.

    Either way the workers are started now, with SIGINT ignored, which they keep: Ctrl-C (SIGINT to the whole
    process group) reaches this process alone, which unwinds and stops them after their batch in hand, instead
    of each worker printing a KeyboardInterrupt traceback (as spawned ones did while still importing). Each
    worker ends with this process however it ends, SIGKILL included (``xprep.prep.lifeline``).
    """
    global _PROCESSOR
    lifeline = (os.getpid(), threading.current_thread() is threading.main_thread())  # (die_with_parent's)
    if not _can_fork(start):
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=(make, args, verdicts(), lifeline))
        with _sigint_ignored():  # while none is idle, each task starts a worker
            return _started(pool, lambda: [pool.submit(int) for _ in range(workers)])
    _PROCESSOR = _build(make, args)
    _PROCESSOR.warm()
    # every object alive now out of the collector's sight (gc.freeze, as its docs advise before a fork): no worker's
    # collection writes to the pages it shares with this process, and none here or there traverses them again
    # (they stay frozen here too: reference counting still frees them, only a cycle among them would wait). Garbage
    # is collected first (~0.01 s): a dead cycle frozen with them would never be freed.
    gc.collect()
    gc.freeze()
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_forked,
                               initargs=(lifeline,))
    with _sigint_ignored(), warnings.catch_warnings():  # Python ≥ 3.12 warns of any fork beside a native pool
        warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
        started = pool.submit(int)  # forks every worker now (a pool using fork starts them all at its first task)
    return _started(pool, started.result)


def _started(pool: ProcessPoolExecutor, start) -> ProcessPoolExecutor:
    """``pool`` once ``start()`` (its first tasks) is done. A worker that dies meanwhile (killed as it appeared)
    ends the command as a death at any later task does: the one-line error, with the pool shut down here rather
    than left to the interpreter's exit."""
    global _PROCESSOR
    try:
        start()
    except BrokenProcessPool:
        pool.shutdown(wait=True, cancel_futures=True)
        _PROCESSOR = None
        raise _worker_died() from None
    return pool


@contextmanager
def _sigint_ignored():
    """SIGINT ignored in this process meanwhile (where it can be: signals are set from the main thread only), so
    that processes started now inherit it ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _can_fork(start: str) -> bool:
    """Whether workers may be forked: asked to (``start``), on Linux, with no other thread that could hold a lock."""
    return (start == "fork" and sys.platform == "linux"
            and threading.active_count() == 1 + render_watchdog_running())


def _forked(lifeline: tuple[int, bool]) -> None:
    die_with_parent(*lifeline)
    # SIGTERM ends a worker at once, as a spawned one (the command's handler, inherited, would unwind it instead)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _build(make: Callable[..., Processor], args: tuple) -> Processor:
    try:
        return make(*args)
    except XprepError:
        raise
    except Exception as e:  # noqa: BLE001 - anything a tokenizer or template library raises
        raise XprepError(f"a tokenize worker could not start: {type(e).__name__}: {e}") from None


def _init_worker(make: Callable[..., Processor], args: tuple, checked: dict, lifeline: tuple[int, bool]) -> None:
    """Build this worker's Processor (with the main process's template verdicts: no self-check, and no Jinja
    compiled until a conversation needs it); a failure is kept and raised by the first task instead.

    An initializer that raises would leave a pool respawning dying workers (multiprocessing.Pool
    does so forever); kept here, the error reaches the main process as the result of a task.
    """
    global _PROCESSOR, _START_ERROR
    die_with_parent(*lifeline)
    # A worker exits once the pool is shut down, every result already sent: skip the interpreter's teardown
    # (freeing the tokenizer and every module took ~0.3 s of each run's end on 2 cores).
    atexit.register(os._exit, 0)
    adopt_verdicts(checked)
    try:
        _PROCESSOR = _build(make, args)
    except XprepError as e:
        _START_ERROR = e


def _work(batch: RawBatch, spill: str) -> Spilled:
    if _START_ERROR is not None:
        raise _START_ERROR
    assert _PROCESSOR is not None
    return Spilled.write(_PROCESSOR(batch), spill)


@dataclass(frozen=True)
class Spilled:
    """A worker's result, left in a file for the main process: what crosses the pipe is this path alone.

    A worker killed while it writes a result into the pipe (the OOM killer, a SIGKILL) leaves a message cut short
    there, and ``concurrent.futures`` reads the rest forever: the command hung, instead of failing. A message this
    small is written whole or not at all (one write, below PIPE_BUF), so the death is seen as a death.
    """

    path: str

    @classmethod
    def write(cls, result: Encoded, directory: str) -> Spilled:
        """``result`` in a new file of ``directory``. A full disk (or the like) is the one-line error, raised in the
        worker and so by the main process's ``future.result()``: the run then ends as any failed run does."""
        data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        with machine_errors(directory, "-o", len(data)):
            fd, path = tempfile.mkstemp(dir=directory)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        return cls(path)

    def load(self) -> Encoded:
        with open(self.path, "rb") as f:
            data = f.read()
        os.remove(self.path)
        return pickle.loads(data)


class Pipeline:
    """Ordered map of a Processor over batches: in one thread beside this one, or over N processes, with
    bounded lookahead.

    One worker runs the Processor in a thread, so that this thread reads, splits, writes and hashes the
    neighbouring batches while the encoder (native code, the GIL released) runs: text tokenizing overlaps
    its Python with its encoding. Worker processes come from ``concurrent.futures``: unlike
    ``multiprocessing.Pool`` it notices a worker that dies (killed, out of memory) and fails every pending
    task instead of waiting forever.

    Each worker runs ``processor(*processor_args)`` (picklable: a spawned worker builds its own);
    ``worker_start``: ``--worker-start``.
    """

    def __init__(self, processor_args: tuple, workers: int, overlap: bool = True, scratch: str | None = None,
                 worker_start: str = "fork", processor: Callable[..., Processor] = Processor):
        self.workers = workers
        self.overlap = overlap  # one worker: its own thread (off where every core already runs a task, as on Ray)
        if workers <= 1:
            self.inline = processor(*processor_args)
            self.pool = None
        else:
            # workers' results (Spilled) go into ``scratch``: the output's temporary directory, removed with it
            # whoever ends the run (a killed one's by the next run), not $TMPDIR, where nothing would remove them
            self.pool = _start_pool(processor, processor_args, workers, worker_start)
            self.spill = tempfile.mkdtemp(prefix="results-", dir=scratch)

    def map(self, batches):
        if self.pool is not None:
            yield from _ordered(batches, self._submit, 2 * self.workers)
            return
        if not self.overlap:
            for b in batches:
                yield b if isinstance(b, Unreadable) else self.inline(b)
            return
        # a thread per map (not per Pipeline): a Ray worker keeps its Pipeline from task to task
        thread = ThreadPoolExecutor(1, thread_name_prefix="xprep-encode")
        try:
            yield from _ordered(batches, lambda b: thread.submit(self.inline, b), 2)
        except BaseException:
            abort_renders()  # (interrupted, or failed) a template's render must not keep this waiting below
            raise
        finally:
            thread.shutdown(wait=True, cancel_futures=True)

    def _submit(self, batch: RawBatch):
        try:
            return self.pool.submit(_work, batch, self.spill)
        except BrokenProcessPool:  # a worker died before this batch could be queued
            raise _worker_died() from None

    def close(self, ok: bool) -> None:
        global _PROCESSOR
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=not ok)
            _PROCESSOR = None  # the one workers were forked with, if they were
            shutil.rmtree(self.spill, ignore_errors=True)  # results a failed run did not read


def _ordered(batches, submit, lookahead: int):
    """Results of ``submit(batch)`` (a future) in batch order, at most ``lookahead`` submitted ahead; Unreadable
    markers pass through in their place."""
    pending: deque = deque()
    for b in batches:
        pending.append(b if isinstance(b, Unreadable) else submit(b))
        if len(pending) >= lookahead:
            yield _result(pending.popleft())
    while pending:
        yield _result(pending.popleft())


def _result(item) -> Encoded | Unreadable:
    if isinstance(item, Unreadable):
        return item
    try:
        result = item.result()
    except BrokenProcessPool:
        raise _worker_died() from None
    return result.load() if isinstance(result, Spilled) else result


def _worker_died() -> XprepError:
    return XprepError("a tokenize worker process died (killed, or out of memory?); nothing was written: "
                      "run again, with fewer --workers if memory is short")


def auto_workers(chat: bool, planned_bytes: int | None) -> int:
    """``--workers 0``: one process per core (at most 8) for chat, whose template rendering is Python, unless the
    input is too small to pay for starting them; one otherwise (gigatoken already encodes on every core).

    Measured on 2 cores (bench/tokenize.py, chitchat with Qwen3's template), before the fast path and with
    spawned workers: 50 MB took 17.2 s with one worker and 10.4 s with two; 5 MB 2.7 s with one and 4.4 s with two
    (each worker loaded the tokenizer and Jinja). Forked (``_start_pool``), two cost about what one does at 5 and
    12 MB (1.4–1.6 s either way), so the floor stays for where workers are spawned.
    """
    if not chat or (planned_bytes is not None and planned_bytes < CHAT_POOL_MIN_BYTES):
        return 1
    return min(os.cpu_count() or 1, 8)
