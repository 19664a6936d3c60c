"""``xprep tokenize --ray``: the same dataset, tokenized as shards on a Ray cluster.

The driver plans shards (prep/sources/shards.py), runs each as one Ray task (``num_cpus=1``, retried by Ray
up to ``--max-retries`` times when its worker or node is lost), and publishes a sharded dataset
(prep/dataset/sharded.py): the finished shards moved into the output in shard order under one manifest, nothing
copied, so the job ends when its last shard does; for a URL output each shard is copied into place inside the store
as it finishes (ray/url_output.py). With ``--merge`` it merges the shards in shard order through the same writer as
a single run instead, so the published dataset is byte for byte the one the command writes without ``--ray``,
manifest included; either way readers see the same documents.

Shards live in a staging area (prep/tokenize/ray/staging.py) beside the output, ``OUT.xprep-shards`` (a directory, or a
URL for an object-store output), which every node must see. A task writes its shard dataset completely, then publishes
it (a rename, or an upload) and writes its completion marker ``KEY.done`` last; a shard
whose marker exists is finished, so a retried or duplicated task is harmless and a rerun of the
same command after a crash reuses every finished shard. The staging area is removed once the
dataset is published.

Under ``--on-error fail`` the first bad record in input order ends the run: a shard that hits one
cancels the shards after it, the shards before it still finish (one of them may hold an earlier
bad record), and the error names the file and its line. Lines of a cut file are counted from each
piece's start on the worker and renumbered by the driver, so no worker reads the file before its
piece.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xprep.prep.dataset import KEPT_TOKENIZER, DatasetWriter, TokenDataset, append_dataset, bin_path, write_sharded
from xprep.prep.errors import XprepError
from xprep.prep.formats import REJECTS
from xprep.prep.fs import is_url
from xprep.prep.io import OutputLock, TempDir, check_output_dir, fsync_dir, fsync_tree
from xprep.prep.progress import Progress
from xprep.prep.sources import Shard, plan_shard, plan_shards
from xprep.prep.tokenize.config import TokenizeConfig
from xprep.prep.tokenize.job import Job
from xprep.prep.tokenize.pool import Pipeline
from xprep.prep.tokenize.ray.staging import ShardDone, ShardOutcome, Staging
from xprep.prep.tokenize.ray.url_output import ShardedURLOutput, shard_name, shifted_rejects
from xprep.prep.tokenize.write import BadInput, check_not_empty, write_all


def tokenize_shard(config: TokenizeConfig, job: Job, shard: Shard, key: str, root: str, cwd: str,
                   env: dict[str, str]) -> ShardOutcome:
    """The Ray task: tokenize one shard into the staging area at ``root`` (or find it already there).

    ``env`` is set in the worker first: the same for every task of the job (a Ray worker serves one job), and
    given here rather than as a ``runtime_env``, for which Ray starts new worker processes instead of using the
    idle ones it keeps (~2 s before the first task ran)."""
    os.environ.update(env)
    if os.path.isdir(cwd):
        os.chdir(cwd)  # inputs and the tokenizer may be given relative to where the command ran
    staging = Staging(root)
    done = staging.finished(key)
    if done is not None:  # a duplicate of a task that already finished
        return ShardOutcome(done=done)
    scratch = staging.scratch()
    out = os.path.join(scratch, "dataset")
    lines_read: list[int] = []
    try:
        with DatasetWriter(out, job.info.vocab_size, job.dtype, durable=False) as writer:  # see ray/staging.py
            pipeline = _pipeline(job)
            quiet = Progress("shard", interval=0, stream=open(os.devnull, "w"))
            categories = write_all(config, job.sources, list(shard.pieces), writer, pipeline, lines_read, quiet,
                                   job.options.category_table())
            manifest = {**job.head, "sources": [job.sources[p.source].describe() for p in shard.pieces]}
            manifest = writer.finish(manifest, categories)
        nbytes = sum(p.stop - p.start for p in shard.pieces)
        done = ShardDone(manifest["counts"]["documents"], manifest["counts"]["tokens"], nbytes, tuple(lines_read))
        staging.publish(out, key, done)
        return ShardOutcome(done=done)
    except BadInput as e:
        return ShardOutcome(bad=(e.path, e.line, e.reason))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


_PIPELINES: dict[int, Pipeline] = {}  # per worker process: tokenizer and template are loaded once, not per task


def _pipeline(job: Job) -> Pipeline:
    key = hash(repr(job.processor_args))
    if key not in _PIPELINES:
        _PIPELINES.clear()
        _PIPELINES[key] = Pipeline(job.processor_args, 1, overlap=False)  # num_cpus=1: one thread of work
    return _PIPELINES[key]


@dataclass
class Cluster:
    """The Ray cluster this command joined; ``leave`` disconnects (and stops a local one started here)."""

    ray: Any
    joined_here: bool

    def leave(self) -> None:
        if self.joined_here:
            self.ray.shutdown()


def join_cluster(address: str) -> Cluster:
    """Join the cluster ``--ray`` names (``auto``: the running one, else a new local one)."""
    ray = _import_ray()
    return Cluster(ray, _connect(ray, address))


def tokenize_on_ray(config: TokenizeConfig, job: Job, out: str, cluster: Cluster) -> tuple[dict, str]:
    """Tokenize on ``cluster`` and publish into ``out``: (manifest, how it ran). The staging area stays: the caller
    removes it (``Staging.beside(config.output).remove()``) once the dataset is where it goes (uploaded, for a
    URL), so that a run that fails before then can still reuse every shard."""
    ray = cluster.ray
    shards = plan_shards(job.sources, config.shard_size)
    key_head = {**job.head, "on_error": config.on_error}
    keys = [s.key(job.sources, key_head) for s in shards]
    staging = Staging.beside(config.output)
    sharded = not config.merge
    results: dict[int, ShardDone] = {}
    # the output is locked (DatasetWriter, ShardedOutput) before the staging area is touched: a second run of the
    # same command stops there, before it prunes the scratch of the first one's tasks (a URL has no lock)
    if sharded and is_url(out):
        output = ShardedURLOutput(out, lambda k: _line_shift(job, shards, results, k))
    elif sharded:
        output = ShardedOutput(out)
    else:
        output = DatasetWriter(out, job.info.vocab_size, job.dtype, tokenizer=job.kept_tokenizer)
    with output as writer, tempfile.TemporaryDirectory() as tmp:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if len(nodes) > 1:
            _check_shared(ray, nodes, staging, job, config)
        staging.prune(set(keys))
        for k, key in enumerate(keys):
            done = staging.reusable(key, len(shards[k].pieces))
            if done is not None:
                results[k] = done
        reused = len(results)
        t0 = time.perf_counter()
        merge = None if sharded else Merge(job, shards, keys, results, staging, writer, tmp)
        on_result = merge.advance if merge else lambda: writer.sync(keys, results, staging)
        retried = _run_shards(ray, config, job, shards, keys, staging, results, on_result)
        t1 = time.perf_counter()
        manifest = _finish_sharded(writer, config, job, shards, keys, results, staging) if sharded else \
            merge.finish(config)
    t2 = time.perf_counter()
    how = (f"ray: {len(shards)} shard{'s' if len(shards) != 1 else ''} on {len(nodes)} node"
           f"{'s' if len(nodes) != 1 else ''}, {reused} reused, {retried} retried")
    if sharded:
        copy = ("`xprep pack` and `xtrain run` read it in place" if is_url(out) else
                "`xprep merge` makes one merged copy of it")  # (merge reads local datasets only)
        print(f"xprep tokenize: ray: shards ran in {t1 - t0:.2f} s; published as a sharded dataset in {t2 - t1:.2f} s "
              f"({copy})", file=sys.stderr)
        return manifest, how + ", sharded"
    merged = _bin_bytes(out, manifest)
    print(f"xprep tokenize: ray: shards ran in {t1 - t0:.2f} s; the merge copied {merged / 1e6:,.1f} MB in "
          f"{merge.seconds:.2f} s ({merged / 1e6 / max(merge.seconds, 1e-9):,.0f} MB/s), {t2 - t1:.2f} s of it after "
          "the last shard", file=sys.stderr)
    return manifest, how


def _bin_bytes(out: str, manifest: dict) -> int:
    """Bytes of the published streams' .bin files: what the merge copied."""
    return sum(bin_path(os.path.join(out, name)).stat().st_size for name in manifest["streams"])


def _run_shards(ray, config, job, shards, keys, staging, results, on_result) -> int:
    """Run every shard not in ``results`` and add it there (then call ``on_result``); returns how many tasks
    were run again (``_Tasks``). Under ``--on-error fail`` the first bad record in input order ends the run."""
    tasks = _Tasks(ray, config, job, shards, keys, staging)
    progress = Progress("tokenize", total_bytes=sum(s.size for s in job.sources), interval=config.progress_every,
                        total_parts=len(shards), part_name="shards")
    for done in results.values():
        progress.update(done.documents, done.tokens, done.bytes, parts=1)
    on_result()
    try:
        for k in range(len(shards)):
            if k not in results:
                tasks.submit(k)
        while tasks.pending:
            for k, outcome in tasks.finished():
                if outcome.bad is not None:
                    tasks.met_bad(k, outcome.bad)
                    continue
                results[k] = outcome.done
                progress.update(outcome.done.documents, outcome.done.tokens, outcome.done.bytes, parts=1)
                if tasks.first_bad is None:
                    on_result()
    finally:
        tasks.cancel_all()
        progress.close()
    if tasks.first_bad is not None:
        k, (path, line, reason) = tasks.first_bad
        raise BadInput(path, line + _line_shift(job, shards, results, k).get(path, 0) if line else 0, reason)
    return sum(tasks.runs.values())


class _Tasks:
    """The shards' tasks on the cluster: submitted, waited for, and run again where their worker was lost.

    A task lost with its worker or node (killed, out of memory, node gone) is submitted again, up to
    --max-retries times, by this driver rather than by Ray, so every retry is counted (``runs``); an error of the
    task's own (a bug, a missing file) is reported with the shard and the worker's message.
    """

    def __init__(self, ray, config: TokenizeConfig, job: Job, shards: list[Shard], keys: list[str],
                 staging: Staging):
        self.ray, self.config, self.job, self.shards, self.keys = ray, config, job, shards, keys
        self.root = staging.root
        self._lost = (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError,
                      ray.exceptions.OutOfMemoryError, ray.exceptions.LocalRayletDiedError)
        # one CPU per task: the encoder's own thread pool is held to it (it would take every core of the node); it
        # is sized when the worker first encodes, after the task has set this
        self._env = {"RAYON_NUM_THREADS": "1", **_store_environment(job, config)}
        self._task = ray.remote(tokenize_shard).options(num_cpus=1, max_retries=0)
        self._job_ref = ray.put(job)
        self.pending: dict = {}  # task ref → shard
        self.runs = dict.fromkeys(range(len(shards)), 0)  # times each shard was run again
        self.first_bad: tuple[int, tuple[str, int, str]] | None = None  # (shard, its bad record) first in order

    def submit(self, k: int) -> None:
        ref = self._task.remote(self.config, self._job_ref, self.shards[k], self.keys[k], self.root, os.getcwd(),
                                self._env)
        self.pending[ref] = k

    def finished(self):
        """(shard, outcome) of each task that ended within a second; a cancelled one is left out, a lost one run
        again."""
        ready, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=1.0)
        for ref in ready:
            k = self.pending.pop(ref)
            outcome = self._outcome(ref, k)
            if outcome is not None:
                yield k, outcome

    def _outcome(self, ref, k: int) -> ShardOutcome | None:
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.TaskCancelledError:
            return None
        except self._lost as e:
            if self.runs[k] < self.config.max_retries:
                self.runs[k] += 1
                self.submit(k)
                return None
            raise XprepError(f"{self._shard(k)} lost its worker {self.runs[k] + 1} times (--max-retries "
                             f"{self.config.max_retries}): {_task_message(e)}") from None
        except self.ray.exceptions.RayError as e:
            raise XprepError(f"{self._shard(k)} failed: {_task_message(e)}") from None

    def _shard(self, k: int) -> str:
        return f"shard {k + 1} of {len(self.shards)} ({self.shards[k].describe(self.job.sources)})"

    def met_bad(self, k: int, bad: tuple[str, int, str]) -> None:
        """Shard k stopped at a bad record: the first in input order is kept, the shards after k cancelled (those
        before it still run: one of them may hold an earlier one)."""
        if self.first_bad is None or k < self.first_bad[0]:
            self.first_bad = (k, bad)
        _cancel(self.ray, [r for r, j in self.pending.items() if j > k])

    def cancel_all(self) -> None:
        _cancel(self.ray, list(self.pending))


class Merge:
    """Appends finished shards in shard order into one writer while later shards still run: the single run's
    bytes, with the copy hidden behind the tokenizing (``advance`` after each result, ``finish`` at the end)."""

    def __init__(self, job, shards, keys, results, staging, writer: DatasetWriter, tmp: str):
        self.job, self.shards, self.keys, self.results = job, shards, keys, results
        self.staging, self.writer, self.tmp = staging, writer, tmp
        self.categories = job.options.category_table()
        self.next = 0  # the first shard not appended yet
        self.seconds = 0.0

    def advance(self) -> None:
        """Append every shard that is finished and next in order."""
        t0 = time.perf_counter()
        while self.next in self.results:
            k, key = self.next, self.keys[self.next]
            local = self.staging.fetch(key, os.path.join(self.tmp, key))
            shift = _line_shift(self.job, self.shards, self.results, k)
            append_dataset(TokenDataset(local), self.writer, self.categories, shift)
            if local.startswith(self.tmp):
                shutil.rmtree(local, ignore_errors=True)
            self.next += 1
        self.seconds += time.perf_counter() - t0

    def finish(self, config: TokenizeConfig) -> dict:
        """Publish: every shard appended, the single run's manifest written."""
        self.advance()
        t0 = time.perf_counter()
        manifest = {**self.job.head, "sources": _run_sources(self.job)}
        check_not_empty(config, self.writer)
        manifest = self.writer.finish(manifest, self.categories)
        self.seconds += time.perf_counter() - t0
        return manifest


def _finish_sharded(writer, config, job, shards, keys, results, staging) -> dict:
    """Publish the sharded output (``ShardedOutput``, or ``ShardedURLOutput`` for a URL): its manifest."""
    if not isinstance(writer, ShardedURLOutput):
        return writer.finish(config, job, shards, keys, results, staging)
    _check_some_documents(config, results)
    writer.sync(keys, results, staging)
    return writer.finish(_sharded_extra(job), job.kept_tokenizer, len(shards))


def _sharded_extra(job: Job) -> dict:
    """What a sharded output's manifest adds to its shards': the run's sources, and the converted tokenizer kept
    beside the manifest (the shards were written without it)."""
    extra = {"sources": _run_sources(job)}
    if job.kept_tokenizer is not None:
        extra["tokenizer"] = {**job.head["tokenizer"], "path": KEPT_TOKENIZER}
    return extra


def _run_sources(job: Job) -> list[dict]:
    """The manifest's ``sources`` of the whole run, as one process would list them (each input once)."""
    return [job.sources[p.source].describe() for p in plan_shard(job.sources, 1, 0)]


class ShardedOutput:
    """The output of ``--ray`` as a sharded dataset: locked from the start (as ``DatasetWriter`` locks it), then at
    the end each finished shard moved, in shard order, from the staging area into a temporary sibling of the output
    as ``shard-NNNNN``, its rejects' line numbers made the whole file's, the sharded manifest written over them, all
    of it made durable, and the directory published by one rename. No token byte is copied."""

    def __init__(self, out: str):
        self.out = check_output_dir(out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._lock = OutputLock(self.out).acquire()
        self._synced: set[int] = set()

    def sync(self, keys: list[str], results: dict[int, ShardDone], staging: Staging) -> None:
        """Make each newly finished shard durable while later ones still run (they were written without fsync:
        ray/staging.py), so that ``finish`` has little left to write back."""
        for k in sorted(set(results) - self._synced):
            fsync_tree(staging.fetch(keys[k], ""))  # (a local staging area: the shard's own directory)
            self._synced.add(k)

    def __enter__(self) -> ShardedOutput:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._lock.release()

    def finish(self, config: TokenizeConfig, job: Job, shards: list[Shard], keys: list[str],
               results: dict[int, ShardDone], staging: Staging) -> dict:
        _check_some_documents(config, results)
        check_output_dir(self.out)  # again, under the lock
        claim = TempDir(self.out.parent, f".{self.out.name}.tmp-{os.getpid()}-")
        try:
            parts = []
            for k, key in enumerate(keys):
                part = claim.path / shard_name(k)
                os.replace(staging.fetch(key, str(part)), part)  # (a local staging area: a rename)
                _shift_rejects(part, _line_shift(job, shards, results, k))
                parts.append(part)
            if job.kept_tokenizer is not None:  # a converted tokenizer, which the shards were written without
                shutil.copyfile(job.kept_tokenizer, claim.path / KEPT_TOKENIZER)
            manifest = write_sharded(parts, claim.path, _sharded_extra(job))
            fsync_tree(claim.path)  # the shards were written without fsync (ray/staging.py)
            claim.release()
            if self.out.exists():
                self.out.rmdir()
            os.replace(claim.path, self.out)
            fsync_dir(self.out.parent)
        except BaseException:
            shutil.rmtree(claim.path, ignore_errors=True)
            claim.release()
            raise
        return manifest


def _check_some_documents(config: TokenizeConfig, results: dict[int, ShardDone]) -> None:
    """As ``check_not_empty`` for a merged output: no document at all is a mistake unless ``--allow-empty``."""
    if not config.allow_empty and not sum(r.documents for r in results.values()):
        raise XprepError(f"{', '.join(config.inputs)}: no document to write; nothing was published (pass "
                         "--allow-empty to write an empty dataset anyway)")


def _shift_rejects(dataset: Path, shift: dict[str, int]) -> None:
    """Renumber a shard's rejects.jsonl from its pieces' starts to whole files' lines (``_line_shift``), atomically."""
    path = dataset / REJECTS
    if not path.is_file() or not any(shift.values()):
        return
    tmp = path.with_name(f".{REJECTS}.tmp")
    tmp.write_bytes(shifted_rejects(path.read_bytes(), shift))
    os.replace(tmp, path)


def _line_shift(job: Job, shards: list[Shard], results: dict[int, ShardDone], k: int) -> dict[str, int]:
    """Lines to add to shard ``k``'s line numbers, per path: the lines its file's earlier pieces read."""
    before: dict[int, int] = {}
    for j in range(k):
        for piece, n in zip(shards[j].pieces, results[j].lines_read, strict=True):
            before[piece.source] = before.get(piece.source, 0) + n
    return {job.sources[p.source].path: before.get(p.source, 0) for p in shards[k].pieces}


STORE_ENV_PREFIXES = ("AWS_", "FSSPEC_", "GOOGLE_", "GCS_", "AZURE_")


def _store_environment(job: Job, config: TokenizeConfig) -> dict[str, str]:
    """The object-store settings of this command's environment (AWS_*, FSSPEC_*, …), given to its tasks when it
    reads or writes URLs: a worker started before them would not see them otherwise. Nodes with their own
    credentials (instance roles) need none; what is set here wins for this job's tasks."""
    if not (is_url(config.output) or any(is_url(s.path) for s in job.sources)):
        return {}
    return {k: v for k, v in os.environ.items() if k.startswith(STORE_ENV_PREFIXES)}


def _cancel(ray, refs) -> None:
    for ref in refs:
        try:
            ray.cancel(ref, force=True)
        except Exception:  # noqa: BLE001 - already finished or gone: nothing to cancel
            pass


def _task_message(error) -> str:
    """The worker's own words for a failed task, without Ray's traceback."""
    cause = getattr(error, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    text = str(error).strip().splitlines()
    return text[-1] if text else type(error).__name__


def _import_ray():
    try:
        import ray  # optional extra: xprep[ray]
    except ImportError:
        raise XprepError("--ray needs the ray package: pip install 'xprep[ray]' (on every node)") from None
    return ray


def _connect(ray, address: str) -> bool:
    """Join the cluster ``--ray`` names; with ``auto`` and none running, start a local one. True if started here.

    An address is first tried with a plain TCP connection: Ray itself retries one that nothing answers for
    ~14 minutes before it gives up.
    """
    quiet = {"logging_level": logging.ERROR, "log_to_driver": False}
    if ray.is_initialized():
        return False
    if address != "auto":
        _check_answers(address, f"--ray {address}", "is `ray start --head` running at that address?")
        try:
            ray.init(address=address, **quiet)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise XprepError(f"--ray {address}: cannot join a Ray cluster there ({e}); is `ray start --head` "
                             "running at that address?") from None
        return True
    if os.environ.get("RAY_ADDRESS"):
        named = f"--ray auto: RAY_ADDRESS={os.environ['RAY_ADDRESS']}"
        _check_answers(os.environ["RAY_ADDRESS"], named, "unset RAY_ADDRESS to start a local cluster")
        try:
            ray.init(address="auto", **quiet)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise XprepError(f"{named}: cannot join the Ray cluster it names ({e})") from None
        return True
    found = _cluster_left_here()
    if found is not None and _unanswered(found) is None:
        try:
            ray.init(address="auto", **quiet)  # the cluster `ray start` left on this machine
            return True
        except (ConnectionError, ValueError, RuntimeError):
            pass
    why = "RAY_ADDRESS unset, no `ray start`" if found is None else f"the cluster `ray start` left at {found} is gone"
    print(f"xprep tokenize: no Ray cluster found ({why}): starting a local one", file=sys.stderr)
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", **quiet)
    return True


def _cluster_left_here() -> str | None:
    """The address of the cluster ``ray.init(address="auto")`` would join (the one ``ray start`` recorded on this
    machine, or a running one), or None. Ray's own lookup, which is not public API: None where it fails."""
    try:
        from ray._private.services import get_ray_address_from_environment  # ray is an optional extra

        return get_ray_address_from_environment("auto", None)
    except Exception:  # noqa: BLE001 - none found (ConnectionError), or another Ray: as if none were found
        return None


def _check_answers(address: str, named: str, hint: str) -> None:
    reason = _unanswered(address)
    if reason is not None:
        raise XprepError(f"{named}: no Ray cluster answers there ({reason}); {hint}")


def _unanswered(address: str, timeout: float = 5.0) -> str | None:
    """Why nothing accepts a TCP connection at ``address`` (HOST:PORT, or ray://HOST:PORT), or None where something
    does (or the address is not of that form: Ray judges it)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__


def _check_shared(ray, nodes: list[dict], staging: Staging, job: Job, config: TokenizeConfig) -> None:
    """With several nodes, every node must see the staging area, local inputs and the tokenizer: ask each one."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # ray is an optional extra

    probe_dir = None if staging.remote else staging._path("probe")
    token = uuid.uuid4().hex
    if probe_dir is not None:
        os.makedirs(probe_dir, exist_ok=True)
        Path(probe_dir, token).touch()
    paths = [os.path.abspath(p) for p in [job.info.path, *(s.path for s in job.sources)] if not is_url(p)]
    if probe_dir is not None:
        paths.insert(0, os.path.join(os.path.abspath(probe_dir), token))
    look = ray.remote(num_cpus=0)(_missing)
    refs = {look.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(paths):
            n for n in nodes}
    try:
        for ref, node in refs.items():
            missing = ray.get(ref, timeout=60)
            if missing:
                raise XprepError(
                    f"--ray: node {node.get('NodeManagerAddress')} cannot see {missing}; with a cluster of "
                    f"{len(nodes)} nodes, -o {config.output}, local inputs and --tokenizer must be on a file system "
                    "every node mounts (NFS, Lustre, …), or inputs and -o must be object-store URLs")
    finally:
        if probe_dir is not None:
            shutil.rmtree(probe_dir, ignore_errors=True)


def _missing(paths: list[str]) -> str | None:
    """The first of ``paths`` this node cannot see (runs on each node)."""
    return next((p for p in paths if not os.path.exists(p)), None)


__all__ = ["tokenize_on_ray", "tokenize_shard"]
