"""``xprep tokenize`` end to end: prepare, tokenize here or as shards on a Ray cluster, publish.

The dataset is written into ``-o`` (atomically, prep/dataset/token_dataset.py), or for an object-store URL into a local
temporary directory that is uploaded once whole, its completion marker last (prep/dataset/remote.py); ``--ray``
without ``--merge`` places its shards at the URL as they finish instead (prep/tokenize/ray/url_output.py). Where the
records are tokenized does not change a byte of it: in this process (with ``--workers`` processes),
as one ``--num-shards`` shard, or on Ray (prep/tokenize/ray/cluster.py).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext

from xprep.prep.dataset import DatasetWriter, check_output_url, count, upload_dataset
from xprep.prep.fs import is_url
from xprep.prep.io import check_output_dir
from xprep.prep.sources import plan_shard
from xprep.prep.tokenize.config import TokenizeConfig
from xprep.prep.tokenize.job import Job, planned_bytes, prepare
from xprep.prep.tokenize.pool import Pipeline, auto_workers
from xprep.prep.tokenize.ray.cluster import join_cluster, tokenize_on_ray
from xprep.prep.tokenize.ray.staging import Staging
from xprep.prep.tokenize.write import check_not_empty, write_all


def run_tokenize(config: TokenizeConfig) -> dict:
    """Run ``xprep tokenize``; returns the written manifest."""
    if is_url(config.output):
        check_output_url(config.output)
    else:
        check_output_dir(config.output)
    if config.ray is not None:
        manifest, job, how = _tokenize_on_ray(config)
    else:
        job = prepare(config)
        say_inputs(job)
        with local_output(config.output) as out:
            manifest, how = _tokenize_here(config, job, out)
    for line in [*job.info.defaults_used(chat=job.template is not None and job.chat), *job.notes]:  # after the work
        print(f"xprep tokenize: note: {line}", file=sys.stderr)
    c = manifest["counts"]
    print(f"xprep tokenize: {count(c['documents'], 'document')}, {count(c['tokens'], 'token')} "
          f"({count(c['loss_tokens'], 'target')}), {manifest['rejects']['count']:,} rejected → {config.output} "
          f"[{job.backend}: {job.backend_reason}, {how}]", file=sys.stderr)
    return manifest


def say_inputs(job: Job) -> None:
    """What directory inputs hold, read and skipped by extension (before the work: a wrong input is seen at once)."""
    for line in job.inputs_read:
        print(f"xprep tokenize: {line}", file=sys.stderr)


def _tokenize_on_ray(config: TokenizeConfig) -> tuple[dict, Job, str]:
    """Prepare (tokenizer, template, inputs: mostly native code) in a thread while this one joins the cluster
    (mostly waiting on Ray's processes): the two fixed costs of a Ray job overlap. Ray is joined from the main
    thread, as it must be to start a local cluster."""
    with ThreadPoolExecutor(1, thread_name_prefix="xprep-prepare") as pool:
        preparing = pool.submit(prepare, config)
        try:
            cluster = join_cluster(config.ray)
        except BaseException:
            preparing.cancel()
            raise
        try:
            job = preparing.result()
            say_inputs(job)
            in_place = is_url(config.output) and not config.merge  # shards placed at the URL as they finish
            with nullcontext(config.output) if in_place else local_output(config.output) as out:
                manifest, how = tokenize_on_ray(config, job, out, cluster)
            Staging.beside(config.output).remove()  # the dataset is published (uploaded): the shards can go
        finally:
            cluster.leave()
    return manifest, job, how


@contextmanager
def local_output(output: str):
    """The directory to write the dataset into: ``output`` itself, or for a URL a local temporary one that is
    uploaded (completion marker last) once the dataset is whole."""
    if not is_url(output):
        yield output
        return
    tmp = tempfile.mkdtemp(prefix=".xprep-upload-")
    try:
        local = os.path.join(tmp, "dataset")
        yield local
        upload_dataset(local, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tokenize_here(config: TokenizeConfig, job: Job, out: str) -> tuple[dict, str]:
    """Tokenize this process's shard (all of the input unless --num-shards) into ``out``: (manifest, how)."""
    sources = job.sources
    plan = plan_shard(sources, config.num_shards, config.shard_index)
    workers = config.workers or auto_workers(job.chat, planned_bytes(sources, plan))
    manifest = dict(job.head)
    with DatasetWriter(out, job.info.vocab_size, job.dtype, tokenizer=job.kept_tokenizer) as writer:
        pipeline = Pipeline(job.processor_args, workers, scratch=writer.scratch(), worker_start=config.worker_start)
        categories = write_all(config, sources, plan, writer, pipeline, categories=job.options.category_table())
        manifest["sources"] = [sources[p.source].describe() for p in plan]
        if config.num_shards > 1:
            manifest["shard"] = {"index": config.shard_index, "count": config.num_shards}
        if plan or config.num_shards == 1:  # a shard given no input (more shards than files) is empty by design
            check_not_empty(config, writer)
        manifest = writer.finish(manifest, categories)
    return manifest, f"{workers} worker{'s' if workers > 1 else ''}"
