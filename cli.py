"""Command lines of ``xprep`` and ``xtrain``: parsing and messages only, the work lives in prep/ and train/.

Every user mistake surfaces as an ``XprepError``; ``main`` prints it as one line and exits 2.

One module for both programs (pyproject's two console scripts point here): each command is parse → build → run, and
its length is the options and their help, written where click reads them; there is no logic to split out.
"""

from __future__ import annotations

import re
import signal
import sys
from functools import wraps
from importlib import metadata
from pathlib import Path

import click
from xprep.prep.errors import XprepError, machine_cause, machine_error
from xprep.prep.formats import MASK_CONVENTIONS, RECORD_FORMATS, TARGET

CP_MODES = ("allgather", "ring", "ulysses", "hybrid")  # xprep.train.cp.CP_MODES, named here without importing torch


def _user_errors(fn):
    """Turn an XprepError, or an OSError of the machine (a full disk, a permission, a read-only filesystem:
    ``xprep.prep.errors.machine_error``), into one line on stderr and exit status 2 (no traceback)."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except XprepError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)
        except Exception as e:  # an OSError of the machine, or one behind another error (a worker's, DCP's)
            cause = machine_cause(e)
            if cause is None:
                raise
            mapped = machine_error(cause, action=None)  # (where the command did not say what it was doing)
            click.echo(f"error: {mapped}", err=True)
            sys.exit(mapped.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


def package_version() -> str:
    """The installed distribution's version; in a source tree that is not installed, pyproject.toml's."""
    try:
        return metadata.version("xprep")
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent / "pyproject.toml"
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        return found.group(1) if found else "unknown"


def _version_option(prog: str):
    """``--version``: print ``PROG VERSION`` and exit (before any command runs)."""
    def show(ctx: click.Context, _param, value: bool) -> None:
        if value and not ctx.resilient_parsing:
            click.echo(f"{prog} {package_version()}")
            ctx.exit()

    return click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=show,
                        help="Print the version and exit.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@_version_option("xprep")
def xprep():
    """Offline data preparation: tokenize corpora, pack documents, inspect what is there."""
    # SIGTERM (Slurm and Kubernetes preemption) unwinds like Ctrl-C: temporary outputs are removed and worker
    # processes stopped on the way out, instead of being left behind by an abrupt exit.
    signal.signal(signal.SIGTERM, _terminated)


def _terminated(signum, frame):
    raise KeyboardInterrupt


# --------------------------------------------------------------------------------------- tokenize
class _ChatTemplateOption(click.Option):
    """``--chat-template``, whose help names the built-in templates of the chat registry, read when it is shown."""

    @property
    def help(self) -> str:
        from xprep.prep.chat import BUILTIN_TEMPLATES  # deferred: the registry loads numpy, for --help only

        return f"auto (the tokenizer's own Jinja template), {', '.join(BUILTIN_TEMPLATES)}, or a Jinja file."

    @help.setter
    def help(self, _value) -> None:  # (click.Option sets it: the text above is the one)
        pass


@xprep.command()
@click.argument("inputs", nargs=-1, required=True)
@click.option("-o", "--output", required=True, help="Output dataset directory (must not exist or be empty).")
@click.option("--tokenizer", "tokenizer", required=True,
              help="tokenizer.json; GPT-2 vocab.json/encoder.json + merges.txt/vocab.bpe; a SentencePiece .model; "
                   "a tiktoken file; or a directory holding one (searched in that order, tokenizer.json first) "
                   "(+ tokenizer_config.json). Formats other than tokenizer.json are converted once to one "
                   "(see README).")
@click.option("--format", "fmt", type=click.Choice(RECORD_FORMATS), default="auto",
              show_default=True, help="Record kind; auto decides per record.")
@click.option("--text-field", default="text", show_default=True, help="Field holding plain text.")
@click.option("--chat-template", cls=_ChatTemplateOption, default="auto", show_default=True)
@click.option("--train-on", type=click.Choice(["assistant", "all"]), default="assistant", show_default=True,
              help="Which chat tokens are training targets.")
@click.option("--category", default=None, help="Category name for every record of this invocation.")
@click.option("--category-field", default=None, help="Record field naming its category.")
@click.option("--mask-convention", type=click.Choice(MASK_CONVENTIONS), default=TARGET, show_default=True,
              help="What loss_mask[t]=1 of a pre-tokenized record means: target = token t is learned (this "
                   "project's; VERL's SFT trainers from 0.6 on); prediction = the prediction made at t, of token "
                   "t+1, is learned (VERL's fsdp_sft_trainer up to 0.5): mask and category_ids move one place on.")
@click.option("--category-names", default=None, metavar="FILE",
              help="JSON {id: name} naming the numeric category_ids of pre-tokenized records (manifest, inspect, "
                   "channel loss); ids it leaves out keep their number.")
@click.option("--append-eod/--no-append-eod", default=None,
              help="Append the end-of-document token (default: on for text, off for chat and tokens).")
@click.option("--workers", type=int, default=0, show_default=True,
              help="Processes, one tokenizer each (0 = auto: all cores, at most 8, for chat data (--format "
                   "chat, or auto when the first record is a conversation); else 1, gigatoken already encoding "
                   "on every core).")
@click.option("--backend", type=click.Choice(["auto", "gigatoken", "hf"]), default="auto", show_default=True,
              help="Encoder: auto = gigatoken where its self-check against HF tokenizers passes, else HF "
                   "tokenizers; gigatoken = fail instead of falling back; hf = HF tokenizers (the reference).")
@click.option("--dtype", type=click.Choice(["auto", "uint16", "int32"]), default="auto", show_default=True,
              help="Token storage; auto = uint16 when vocab < 65,500.")
@click.option("--num-shards", type=int, default=1, show_default=True,
              help="Split the input bytes into N contiguous shards (one job each, e.g. a Slurm array); "
                   "`xprep merge` joins their outputs.")
@click.option("--shard-index", type=int, default=0, show_default=True,
              help="Which shard (0 … N-1) this run tokenizes.")
@click.option("--on-error", type=click.Choice(["fail", "skip"]), default="fail", show_default=True,
              help="fail: stop at the first bad record; skip: write it to rejects.jsonl and go on.")
@click.option("--limit", type=int, default=None, help="Read at most N records.")
@click.option("--eod-token", default=None,
              help="End-of-document token [default: the tokenizer_config.json eos_token, else the one the tokenizer "
                   "files name (SentencePiece's eos piece, GPT-2's <|endoftext|>), else a usual one found in the "
                   "vocabulary, said on the console]. For GPT-2, SentencePiece or tiktoken files a token the "
                   "vocabulary lacks is added (TOKEN=ID chooses its id).")
@click.option("--bos-token", default=None,
              help="BOS token that chat templates render as bos_token ('' for none) [default: the "
                   "tokenizer_config.json bos_token, else the one the tokenizer files name, else a usual one found "
                   "in the vocabulary]. For GPT-2, SentencePiece or tiktoken files a token the vocabulary lacks is "
                   "added (TOKEN=ID chooses its id).")
@click.option("--role-map", default=None,
              help="Extra chat roles as FROM=TO,... with TO one of system, user, assistant, tool "
                   "(e.g. chatgpt=assistant; common ShareGPT names are known already).")
@click.option("--allow-empty", is_flag=True,
              help="Publish a dataset even when no document (or no target token) is left.")
@click.option("--progress-every", type=float, default=30.0, show_default=True,
              help="Seconds between progress lines when stderr is not a terminal (logs, Slurm); 0 = none.")
@click.option("--ray", "ray_address", is_flag=False, flag_value="auto", default=None, metavar="[auto|ADDRESS]",
              help="Run the shards as tasks on a Ray cluster: auto = RAY_ADDRESS or the `ray start` cluster here, "
                   "else a local one; HOST:PORT = that cluster. Same output as without it.")
@click.option("--shard-size", default="256MB", show_default=True,
              help="With --ray: input bytes per task (JSON Lines files are cut at lines, Parquet at row groups).")
@click.option("--max-retries", type=int, default=3, show_default=True,
              help="With --ray: times a task lost with its worker or node is run again.")
@click.option("--merge", "merge_shards", is_flag=True,
              help="With --ray: publish one merged dataset (the bytes of a run without --ray) rather than a sharded "
                   "dataset over the tasks' shards (the default; for a URL -o, each shard is placed there as it "
                   "finishes and the manifest last).")
@click.option("--cache-dir", default=None, metavar="DIR",
              help="Where tokenizers converted from GPT-2, SentencePiece or tiktoken files and facts about "
                   "tokenizers are kept, to be reused [default: $XPREP_CACHE_DIR, else ~/.cache/xprep].")
@click.option("--chat-render", type=click.Choice(["auto", "records", "jinja"]), default="auto", show_default=True,
              help="Which chat renderer runs; the dataset is the same, byte for byte: auto = the fastest that passed "
                   "its check against the template's Jinja (column-wise for whole batches, else record by record); "
                   "records = record by record (a known template's renderer, else Jinja); jinja = the template's "
                   "own Jinja for every conversation (slow: to rule the others out when comparing).")
@click.option("--worker-start", type=click.Choice(["fork", "spawn"]), default="fork", show_default=True,
              help="How worker processes start: fork = from this process once it loaded the tokenizer, where that "
                   "is safe (Linux, no other thread), else spawn; spawn = each starts fresh (slower to start).")
@_user_errors
def tokenize(inputs, output, tokenizer, fmt, text_field, chat_template, train_on, category,
             category_field, mask_convention, category_names,
             append_eod, workers, backend, dtype, num_shards, shard_index, on_error, limit,
             eod_token, bos_token, role_map, allow_empty, progress_every, ray_address, shard_size, max_retries,
             merge_shards, cache_dir, chat_render, worker_start):
    """Tokenize INPUT files/dirs/globs (local, or fsspec URLs such as s3://bucket/data/*.jsonl.zst) into a
    Megatron-compatible token dataset (-o may be a URL too)."""
    from xprep.prep.sources import parse_size  # deferred: as below
    from xprep.prep.tokenize import (
        TokenizeConfig,  # deferred: tokenizers and numpy load for this command only
        run_tokenize,
    )

    config = TokenizeConfig(
        inputs=list(inputs), output=output, tokenizer=tokenizer, format=fmt, text_field=text_field,
        chat_template=chat_template, train_on=train_on, category=category, category_field=category_field,
        mask_convention=mask_convention, category_names=category_names,
        append_eod=append_eod, workers=workers, backend=backend, dtype=dtype, num_shards=num_shards,
        shard_index=shard_index, on_error=on_error, limit=limit, eod_token=eod_token, bos_token=bos_token,
        role_map=role_map, allow_empty=allow_empty, progress_every=progress_every,
        ray=ray_address, shard_size=parse_size(shard_size), max_retries=max_retries, merge=merge_shards,
        cache_dir=cache_dir,
        chat_render=chat_render, worker_start=worker_start,
    )
    run_tokenize(config)


@xprep.command()
@click.argument("datasets", nargs=-1, required=True)
@click.option("-o", "--output", required=True, help="Merged dataset directory.")
@click.option("--sharded", is_flag=True,
              help="Write a sharded dataset instead: a manifest listing DATASETS as its shards, nothing copied.")
@_user_errors
def merge(datasets, output, sharded):
    """Concatenate token datasets (e.g. shards, or a sharded dataset's) into one, in the given order."""
    from xprep.prep.dataset import merge_datasets, write_sharded  # deferred: numpy loads for this command only

    manifest = (write_sharded if sharded else merge_datasets)(list(datasets), output)
    c = manifest["counts"]
    click.echo(f"{'listed' if sharded else 'merged'} {len(datasets)} datasets into {output}: {c['documents']:,} "
               f"documents, {c['tokens']:,} tokens")


# ------------------------------------------------------------------------------------------- pack
class _PackMethods(click.Choice):
    """``--method``'s choices: the names in the packing-method registry when they are needed (a value to check,
    the help), not at import: the registry loads numba, which no other command needs, and a method registered
    after this module is imported (a plugin, a test) is accepted and listed."""

    def __init__(self):
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        from xprep.prep.pack import method_names  # deferred: numba loads with the registry, for `pack` only

        return method_names()

    @choices.setter
    def choices(self, _value) -> None:  # (click's __init__ sets it: the registry is the one source)
        pass


class _MethodsHelp(click.Option):
    """An option of ``xprep pack`` whose help names packing methods: written from the registry when the help is
    shown (``methods_help(methods)``), so it names the registered ones, and the other commands never load it."""

    def __init__(self, *args, methods_help, **kwargs):
        super().__init__(*args, **kwargs)
        self.methods_help = methods_help

    def get_help_record(self, ctx: click.Context):
        from xprep.prep.pack import packing_methods  # deferred: numba loads with the registry, for `pack` only

        self.help = self.methods_help(packing_methods())
        return super().get_help_record(ctx)


def _named(methods, keep, join: str = ", ") -> str:
    """The names of the ``methods`` that ``keep`` selects, for a help line."""
    return join.join(m.name for m in methods if keep(m))


def _overlong_defaults(methods) -> str:
    """``split for sequential; drop for multipack, token-aware``: each policy and the methods it is the default of
    (a method of fixed-length samples cuts every document: none is overlong)."""
    methods = [m for m in methods if not m.fixed_length_samples]
    policies = dict.fromkeys(m.default_overlong for m in methods)
    return "; ".join(f"{p} for {_named(methods, lambda m, p=p: m.default_overlong == p)}" for p in policies)


@xprep.command()
@click.argument("datasets", nargs=-1, required=False, metavar="DATASET[@WEIGHT[:method=M,overlong=P]]...")
@click.option("-o", "--output", required=True, help="Pack cache directory (created; entries keyed inside).")
@click.option("--method", required=True, type=_PackMethods(), cls=_MethodsHelp,
              methods_help=lambda ms: "; ".join(f"{m.name}: {m.help}" for m in ms) + ".")
@click.option("--seq-len", type=int, default=None, cls=_MethodsHelp, methods_help=lambda ms: (
    f"Bin capacity in tokens ({_named(ms, lambda m: m.sized_by == 'seq_len' and not m.fixed_length_samples)}), "
    f"the sample length for {_named(ms, lambda m: m.fixed_length_samples)}."))
@click.option("--max-tokens", type=int, default=None, cls=_MethodsHelp, methods_help=lambda ms: (
    f"Token budget of a micro-batch ({_named(ms, lambda m: m.sized_by == 'max_tokens')})."))
@click.option("--overlong", type=click.Choice(["drop", "truncate", "split"]), default=None, cls=_MethodsHelp,
              methods_help=lambda ms: (
                  f"Documents longer than the capacity. Default: {_overlong_defaults(ms)}; in a blend, split for a "
                  "source without a loss mask. A blend source sets its own with DATASET@WEIGHT:overlong=P (or "
                  "overlong: in --mix)."))
@click.option("--cp-size", type=int, default=1, show_default=True, cls=_MethodsHelp, methods_help=lambda ms: (
    "Context-parallel size C: each document counts as its length rounded up to a multiple of 2·C; the capacity "
    f"must be a multiple of 2·C. For --method {_named(ms, lambda m: m.fixed_length_samples, ' or ')} it only checks "
    "that 2·C divides --seq-len (whole samples are zigzagged, nothing is padded)."))
@click.option("--group-size", type=int, default=None, cls=_MethodsHelp, methods_help=lambda ms: (
    f"{_named(ms, lambda m: 'group_size' in m.options)}: documents per independently packed group "
    "[default: 100000]."))
@click.option("--balance-dp", type=int, default=None, cls=_MethodsHelp, methods_help=lambda ms: (
    f"{_named(ms, lambda m: 'balance_dp' in m.options)}: arrange bins in steps over N data-parallel ranks, "
    "balancing Σ len²."))
@click.option("--dp-micro-batches", type=int, default=None,
              help="With --balance-dp: bins per rank per balanced step [default: 16].")
@click.option("--shuffle/--no-shuffle", default=None, cls=_MethodsHelp, methods_help=lambda ms: (
    f"Permute documents (seeded) before packing. Default: on for {_named(ms, lambda m: m.default_shuffle)}, "
    "off otherwise."))
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of --shuffle.")
@click.option("--force", is_flag=True, help="Rebuild the entry even if the cache has it.")
@click.option("--allow-empty", is_flag=True,
              help="Publish a pack of 0 bins (no documents, or all empty or dropped) instead of failing.")
@click.option("--mix", "mix", default=None, metavar="FILE.yaml",
              help="A blend: a YAML (or JSON) file naming datasets, their weights and optional category names "
                   "(instead of, or besides, DATASET@WEIGHT arguments).")
@click.option("--total-tokens", type=int, default=None, cls=_MethodsHelp, methods_help=lambda ms: (
    f"Size of a blend, or of a {_named(ms, lambda m: m.fixed_length_samples, ' or ')} pack (the stream repeated "
    "as needed), in tokens."))
@click.option("--epochs", type=float, default=None, cls=_MethodsHelp, methods_help=lambda ms: (
    f"Size in epochs instead: of the stream for {_named(ms, lambda m: m.fixed_length_samples)}, of the largest "
    "share for a blend."))
@click.option("--split", default=None, metavar="TRAIN,VALID[,TEST]",
              help="Hold out documents for validation (and test), e.g. 99,1 or Megatron's 969,30,1 (shares, "
                   "normalized; decimals too): which documents are held out follows from a hash of their dataset's "
                   "content and index alone (no seed, no pack option), so they stay on the same side however the "
                   "data is re-packed; with three shares each part has Megatron's document count. The validation "
                   "and test parts are their own entries; a zero share means no such part.")
@click.option("--cache-dir", default=None, metavar="DIR",
              help="Where what is fetched of datasets given as URLs (s3://…) is kept, by fingerprint: a pack "
                   "(a blend too) reads a dataset at a URL in place and keeps its manifest and indexes there "
                   "[default: $XPREP_CACHE_DIR, else ~/.cache/xprep].")
@click.option("--attention", type=click.Choice(["document", "causal"]), default="document", show_default=True,
              cls=_MethodsHelp, methods_help=lambda ms: (
                  f"Inside a {_named(ms, lambda m: m.fixed_length_samples, ' or ')} sample: document keeps its "
                  "documents apart (attention, positions and labels restart at each); causal is Megatron "
                  "GPTDataset's default, one causal span over the sample, positions 0..S-1, labels across documents."))
@click.option("--eod-mask-loss", is_flag=True, cls=_MethodsHelp, methods_help=lambda ms: (
    f"{_named(ms, lambda m: m.fixed_length_samples)}: no EOD token (the datasets' eod_id) is a target."))
@_user_errors
def pack(datasets, output, method, seq_len, max_tokens, overlong, cp_size, group_size, balance_dp,
         dp_micro_batches, shuffle, seed, force, allow_empty, mix, total_tokens, epochs, split, cache_dir,
         attention, eod_mask_loss):
    """Pack token DATASETs (one global document index, in order) into a hash-keyed cache entry."""
    # deferred, as every command's: numba/numpy load only for the command run
    from xprep.prep.inspect import outcome_report, summary_lines, warning_lines
    from xprep.prep.interrupt import run_interruptibly
    from xprep.prep.pack import PackConfig, parse_sources, parse_split
    from xprep.prep.pack import pack as run_pack

    paths, weights, options = parse_sources(datasets, mix)
    paths = [_dataset_argument(p) for p in paths]  # (datasets at URLs, of a blend too, are read in place)
    config = PackConfig(method=method, seq_len=seq_len, max_tokens=max_tokens, overlong=overlong,
                        cp_size=cp_size, group_size=group_size, balance_dp=balance_dp,
                        dp_micro_batches=dp_micro_batches, shuffle=shuffle, seed=seed, total_tokens=total_tokens,
                        epochs=epochs, split=parse_split(split), attention=attention, eod_mask_loss=eod_mask_loss)
    # Packing runs numba kernels, which an interrupt cannot stop midway: run_interruptibly keeps Ctrl-C to one line
    outcome = outcome_report(run_interruptibly(lambda: run_pack(
        paths, output, config, force=force, allow_empty=allow_empty, log=lambda m: click.echo(m, err=True),
        weights=weights, mix=mix, source_options=options, cache_dir=cache_dir)))
    click.echo("\n".join(summary_lines(outcome)))
    for line in warning_lines(outcome):
        click.echo(line, err=True)


def _dataset_argument(path: str) -> str:
    """A dataset to pack: a URL as it is (packing reads its index in place: prep/dataset/stream.py), a path."""
    from xprep.prep.fs import is_url, local_path  # deferred, as every command's

    return path if is_url(path) else local_path(path)


# ---------------------------------------------------------------------------------------- inspect
@xprep.command()
@click.argument("paths", nargs=-1, required=True, metavar="PATH...")
@click.option("--json", "as_json", is_flag=True,
              help="Print a JSON report instead of tables (a list of reports for several paths).")
@click.option("--html", "html", default=None, metavar="OUT.html",
              help="Also write one self-contained page for every PATH (datasets, packs and runs in any mix): "
                   "charts and tables, viewable offline; several runs are overlaid.")
@click.option("--sample", type=int, default=None, metavar="N",
              help="Token dataset: print N documents decoded with the dataset's tokenizer, target tokens "
                   "marked (colour on a terminal, [[...]] otherwise) and category names shown; the first N "
                   "unless --seed.")
@click.option("--seed", type=int, default=None,
              help="With --sample: draw the N documents at random with this seed instead of taking the first N.")
@click.option("--over", default=None, metavar="L1,L2,...",
              help="Token dataset: count the documents (and tokens) longer than each length, e.g. 2048,4096,8192 "
                   "[default: powers of two from 1024 up to the longest document].")
@click.option("--plot", default=None, metavar="FILE",
              help="Run directory: draw the loss curves (overall and per category) into FILE (.png, .pdf or "
                   ".svg; needs matplotlib). Without it nothing is written.")
@click.option("--seen", is_flag=True,
              help="Run directory: list the documents trained on (dataset, index, source, categories, tokens) up "
                   "to --step, with tokens per source and per category.")
@click.option("--step", type=int, default=None, metavar="N",
              help="With --seen: up to step N [default: the latest checkpoint, else the last logged step].")
@click.option("--cache-dir", default=None, metavar="DIR",
              help="Where what is fetched of datasets and packs given as URLs (s3://…) is kept: a dataset's manifest "
                   "and indexes, by fingerprint (never its tokens: --sample reads its documents by range), a pack's "
                   "entry files [default: $XPREP_CACHE_DIR, else ~/.cache/xprep].")
@_user_errors
def inspect(paths, as_json, sample, seed, over, plot, seen, step, html, cache_dir):
    """Report on token datasets, pack caches (every entry, then the current one) and run directories, local or at
    URLs (s3://, gs://: read where they are; a run directory must be local)."""
    from xprep.prep.inspect import (  # deferred: numpy and the report modules load on use
        InspectOptions,
        check_target,
        kind_of,
        render,
        to_json,
        write_page,
    )

    options = InspectOptions(sample=sample, seed=seed, over=over, plot=plot, cache_dir=cache_dir)
    found = [(path, kind_of(path)) for path in paths]
    options.check_applies_to(found)
    if step is not None and not seen:
        raise XprepError(f"--step {step} applies only with --seen (the documents trained on up to step N)")
    if seen and (len(found) > 1 or html is not None):
        raise XprepError("--seen lists what one run directory trained on: give one path, without --html")
    if seen and found[0][1] != "run":
        raise XprepError(f"--seen applies only to a run directory, and {paths[0]} is not one; drop --seen")
    if html is not None:
        check_target(html)  # before any work
    reports = [_report(kind, path, options, seen, step) for path, kind in found]
    if html is not None:
        write_page(reports, html)
        click.echo(f"page written to {html} ({len(reports)} report{'s' * (len(reports) > 1)})", err=True)
    if as_json:
        click.echo(to_json(reports[0] if len(reports) == 1 else reports))
    else:
        click.echo("\n\n".join(render(r, color=sys.stdout.isatty()) for r in reports))


def _report(kind: str, path: str, options, seen: bool = False, step: int | None = None):
    """The report of the module that owns this kind of data (prep/ never reads a run directory)."""
    if kind == "dataset":
        from xprep.prep.inspect import (
            dataset_report,  # deferred: tokenizers and numpy, for this kind only
        )

        return dataset_report(path, options)
    if kind == "packed":
        from xprep.prep.inspect import pack_report  # deferred: numpy, for this kind only

        return pack_report(path, options.cache_dir)
    if seen:
        from xprep.train.lineage import seen_report  # deferred: train/ is read only for a run directory

        return seen_report(path, step)
    from xprep.train.report import run_report  # deferred: train/ is read only for a run directory

    return run_report(path, plot=options.plot)


# ----------------------------------------------------------------------------------------- xtrain
@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@_version_option("xtrain")
def xtrain():
    """Train on packs written by `xprep pack`."""


@xtrain.command()
@click.argument("packed", required=False)
@click.option("--config", "config_file", default=None, help="JSON (or YAML, with PyYAML) file of config keys; "
              "flags override it.")
@click.option("--model", default=None, help="Preset (tiny, small, medium, 1b), a JSON model config, or hf:DIR "
              "[default: tiny].")
@click.option("--steps", type=int, default=None, help="Optimizer steps (exclusive with --epochs).")
@click.option("--epochs", type=float, default=None, help="Passes over the bins [default: 1 when no --steps].")
@click.option("--micro-batch-size", type=int, default=None, help="Bins per micro-batch per rank [default: 1].")
@click.option("--global-batch-size", type=int, default=None,
              help="Bins per optimizer step over all ranks [default: micro-batch × ranks, or the step "
                   "of a pack made with --balance-dp].")
@click.option("--allow-new-global-batch/--no-allow-new-global-batch", default=None,
              help="Resume a checkpoint on another --global-batch-size, from the bins it had consumed (Megatron's "
                   "behaviour; the steps' bins then differ from the uninterrupted run's) [default: refused].")
@click.option("--sampler", type=click.Choice(["sequential", "random"]), default=None,
              help="Bin order: Megatron sequential, or a permutation per epoch [default: sequential].")
@click.option("--category-weight", multiple=True, metavar="NAME=W", callback=lambda _c, _p, v: v or None,
              help="Weight of category NAME's target tokens in the training loss, repeatable [default: 1 each]. The "
                   "loss is Σ w·CE / Σ w over each step's global batch, a token's w its category's weight × its "
                   "source's; 0 keeps the tokens in the forward and in the per-category losses but out of the "
                   "gradient. metrics.jsonl's loss is then the weighted one, token_loss the plain token mean; the "
                   "validation loss stays unweighted.")
@click.option("--source-weight", multiple=True, metavar="NAME=W", callback=lambda _c, _p, v: v or None,
              help="Weight of blend source NAME's target tokens in the training loss (times their category's), "
                   "repeatable [default: 1 each].")
@click.option("--seed", type=int, default=None, help="Init and sampler seed [default: 0].")
@click.option("--lr", type=float, default=None, help="Peak learning rate [default: 3e-4].")
@click.option("--min-lr", type=float, default=None,
              help="Where the decay ends, one step after the last [default: 0].")
@click.option("--warmup", type=int, default=None, help="Linear warm-up steps [default: 0].")
@click.option("--schedule", type=click.Choice(["cosine", "linear", "constant", "wsd", "wsd-sqrt"]), default=None,
              help="After the warm-up: cosine or linear decay, reaching --min-lr one step after the last (every "
                   "step trains above it); constant; wsd / wsd-sqrt: the peak lr, then linear / 1-sqrt decay over the "
                   "last --decay-fraction of the steps [default: cosine].")
@click.option("--decay-fraction", type=float, default=None,
              help="wsd, wsd-sqrt: share of the steps over which the lr decays to --min-lr [default: 0.2].")
@click.option("--weight-decay", type=float, default=None, help="AdamW weight decay [default: 0.1].")
@click.option("--beta1", type=float, default=None, help="[default: 0.9]")
@click.option("--beta2", type=float, default=None, help="[default: 0.95]")
@click.option("--grad-clip", type=float, default=None, help="Max gradient norm, 0 = off [default: 1.0].")
@click.option("--max-bad-steps", type=int, default=None, metavar="K",
              help="A step whose loss or gradient norm is non-finite (NaN/inf, on any rank) is skipped: no update, "
                   "the lr schedule held, its batches consumed, said on the console and in metrics.jsonl "
                   "(skipped, bad_steps), and no checkpoint saved while the last step was bad. K in a row stop the "
                   "run with exit status 3, the last good checkpoint staying latest [default: 5].")
@click.option("--inject-nonfinite", default=None, hidden=True, metavar="KIND:RANK:STEP,...",
              help="Tests only: make RANK's loss (loss) or reduced gradients (grad) non-finite at STEP.")
@click.option("--precision", type=click.Choice(["auto", "fp32", "bf16"]), default=None,
              help="Forward/backward dtype; weights, gradients, optimizer state and the loss stay fp32. bf16: "
                   "FSDP2's mixed precision (fp32 shards, bf16 compute, fp32 reduction), autocast without FSDP2. "
                   "auto: bf16 on a GPU with bf16 tensor cores (compute capability ≥ 8.0), else fp32 (older GPUs, CPU) "
                   "[default: auto].")
@click.option("--tf32/--no-tf32", default=None,
              help="CUDA: fp32 matmuls on TF32 tensor cores, and an fp32 run's MFU measured against the TF32 peak; "
                   "--no-tf32: full fp32 matmuls [default: on].")
@click.option("--loss-chunk", type=int, default=None, metavar="N",
              help="Compute the output layer and the loss N tokens at a time, recomputing each chunk's logits in "
                   "the backward: no whole tokens × vocab logits, same loss; 0 = all at once [default: auto: 0 "
                   "while a micro-batch's fp32 logits (tokens × vocab × 4 bytes) take at most 1 GiB, else chunks "
                   "whose logits take at most 256 MiB (512 tokens for a 128k vocabulary), said on the console].")
@click.option("--compile/--no-compile", default=None,
              help="torch.compile each decoder block (attention stays outside the graphs) [default: off].")
@click.option("--init-from", default=None, metavar="PATH|hf:DIR",
              help="Start from the model weights only of an xtrain checkpoint (a step-<N> directory, or a run "
                   "directory: its newest complete checkpoint) or of hf:DIR, with a fresh optimizer, schedule and "
                   "sampler, at step 0; the model must be the same, the pack may differ. Precedence: the run's own "
                   "checkpoint > --resume PATH > --init-from: a run (or requeued job) with a checkpoint of its own "
                   "resumes and --init-from is not used (said on the console); with --resume never such a run is "
                   "refused.")
@click.option("--output", "-o", default=None,
              help="Run directory [default: runs/<pack directory name>]. An existing run's config.json gives the "
                   "defaults: `xtrain run -o RUN` alone resumes it; flags given override it (said on the console).")
@click.option("--save-every", type=int, default=None, help="Checkpoint every N steps; 0 = at the end only.")
@click.option("--save-every-minutes", type=float, default=None, metavar="M",
              help="Also checkpoint once M minutes have passed since the last checkpoint (all ranks at the same "
                   "step); 0 = off [default: 0]. SIGTERM, SIGINT and SIGUSR1 always checkpoint the step reached "
                   "before the run stops (exit 143, 130 and 0).")
@click.option("--keep", default=None, metavar="N|all",
              help="Newest checkpoints kept, plus the best (by validation loss when the run evaluates, else by "
                   "training loss); all: every one [default: 2].")
@click.option("--resume", default=None, help="auto (latest checkpoint, if any), never, or a checkpoint path "
              "[default: auto]. A checkpoint resumes on the pack entry it was trained on while the cache holds it.")
@click.option("--eval-every", type=int, default=None,
              help="Evaluate on the pack's validation entry (`xprep pack --split`) every N steps and after the "
                   "last [default: after the last step only, when the pack has a validation entry].")
@click.option("--eval-bins", default=None, metavar="M|all",
              help="Evaluate on M validation bins evenly spaced over the entry, or all of them [default: 256, or all "
                   "when fewer]. A long evaluation shows its progress.")
@click.option("--eval", multiple=True, metavar="NAME=PACKED_OR_ENTRY",
              callback=lambda _ctx, _param, value: list(value) or None,
              help="Also evaluate this named set (a pack cache's current entry, or an entry) whenever validation "
                   "runs, logged as eval/NAME/... (the pack's validation entry is the set named valid); repeatable. "
                   "Its tokenizer and capacity must be the run's.")
@click.option("--test", default=None, metavar="NAME=PACKED_OR_ENTRY",
              help="Evaluate this set once, after the last step (logged as test/NAME/..., kept in run.json) "
                   "[default: the pack's --split test entry, named test, when it has one].")
@click.option("--log-every", type=int, default=None, help="Console line every N steps [default: 10].")
@click.option("--log", default=None, metavar="tensorboard,wandb",
              help="Also log every step's metrics to TensorBoard (RUN/tensorboard/) and/or Weights & Biases "
                   "(RUN/wandb/; WANDB_MODE=offline writes local files only), comma-separated; needs "
                   "pip install 'xprep[tensorboard]' / 'xprep[wandb]' [default: metrics.jsonl and the console only].")
@click.option("--peak-tflops", type=float, default=None,
              help="Peak dense TFLOPS of one GPU, for MFU [default: looked up by GPU name, for the precision the run "
                   "computes in (bf16: H100 989, A100 312; fp32 with TF32: H100 494.5, A100 156, ...); none on CPU, "
                   "an unknown GPU or a MIG slice, and MFU is then not reported].")
@click.option("--verify-data/--no-verify-data", default=None,
              help="Re-hash the dataset streams against their manifests first (catches in-place edits).")
@click.option("--prefetch-steps", type=int, default=None,
              help="Datasets at URLs (s3://, gs://): steps whose token bytes a background thread fetches ahead "
                   "[default: 4].")
@click.option("--cache-size", default=None, metavar="BYTES",
              help="Datasets at URLs: size of the local cache of fetched blocks, per process, e.g. 2GB or 512MiB "
                   "[default: 2GB].")
@click.option("--stream-timeout", type=float, default=None, metavar="SECONDS",
              help="Datasets at URLs: how long a read retries transient errors before the run stops with a "
                   "checkpoint (the same command resumes) [default: 120].")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None,
              help="Where the ranks compute. auto: a GPU per local rank when the machine has GPUs (an error when it "
                   "has fewer than the ranks), else the CPU; cpu: the CPU (gloo) even on a GPU machine; cuda: a GPU "
                   "per local rank or an error [default: $XTRAIN_DEVICE, else auto].")
@click.option("--nproc-per-node", type=int, default=None,
              help="Start this many ranks on this machine (torch's elastic launcher, as torchrun does) "
                   "[default: this process only, or the ranks torchrun started].")
@click.option("--dp", type=int, default=None, help="Data-parallel degree [default: processes / cp].")
@click.option("--cp", type=int, default=None,
              help="Context-parallel degree: documents split zigzag over C ranks; needs a pack made with "
                   "--cp-size C [default: 1].")
@click.option("--cp-mode", type=click.Choice(CP_MODES), default=None,
              help="How attention reaches the other CP ranks' tokens. ring: K/V blocks passed around the C ranks, "
                   "serves any head count, K/V memory O(T/C) per rank; allgather: every rank holds the whole K/V "
                   "(the reference); ulysses: all-to-all over heads, the heads must be divisible by C; hybrid: "
                   "ulysses inside groups of --ulysses ranks, ring across the groups [default: ring].")
@click.option("--ulysses", type=int, default=None, metavar="N",
              help="--cp-mode hybrid: ranks per Ulysses group, dividing --cp and the heads (--cp C = N × ring size).")
@click.option("--fsdp/--no-fsdp", default=None,
              help="Shard parameters, gradients and optimizer state with FSDP2 over all ranks "
                   "[default: on with more than one process].")
@click.option("--reshard-after-forward/--no-reshard-after-forward", default=None,
              help="FSDP2: free gathered block weights after the forward, gather again for the backward "
                   "[default: on].")
@click.option("--activation-checkpointing/--no-activation-checkpointing", default=None,
              help="Recompute each block's activations in the backward [default: off].")
@click.option("--reduce-every-micro-batch/--reduce-once-per-step", default=None,
              help="FSDP2 with accumulation: reduce-scatter gradients after every micro-batch so they stay "
                   "sharded, or once per step: fewer collectives, but every rank holds the whole model's unsharded "
                   "fp32 gradients between micro-batches (4 bytes × parameters: ~5 GB per GPU at 1B, ~32 GB at 8B); "
                   "same gradients [default: every micro-batch].")
@click.option("--dist-timeout", type=float, default=None, metavar="SECONDS",
              help="How long a collective of the default process group (each step's all-reduces, barriers) waits "
                   "for a peer before the rank fails, so that a rank that hangs ends the job "
                   "[default: $XTRAIN_DIST_TIMEOUT, else 600].")
@click.option("--async-save/--no-async-save", default=None,
              help="Write checkpoints in a background thread; each is published as soon as it is written "
                   "[default: off].")
@click.option("--no-save/--save", default=None,
              help="Write no checkpoint at all, not even the last; resuming from one still works [default: save].")
@click.option("--save-hf/--no-save-hf", default=None,
              help="Also write the model as a Hugging Face directory after the last step: RUN/hf/step-<N>/ "
                   "(model.safetensors, config.json, tokenizer, as `xtrain export` writes), RUN/hf/latest linking to "
                   "the newest; with or without DCP checkpoints [default: off].")
@click.option("--save-hf-every", type=int, default=None, metavar="N",
              help="With --save-hf: also every N steps; 0 = after the last step only [default: 0].")
@click.option("--checkpoint-timeout", type=float, default=None, metavar="SECONDS",
              help="How long the ranks wait for each other while a checkpoint is written, published and loaded "
                   "(slow shared storage), instead of --dist-timeout [default: $XTRAIN_CKPT_TIMEOUT, else 14400].")
@_user_errors
def run(packed, config_file, **options):
    """Train on the current entry of the pack cache PACKED (works under torchrun too); resume RUN with
    `xtrain run -o RUN` alone."""
    from xprep.train.config import resolve_config  # the trainer and torch: deferred, `xprep` never needs them
    from xprep.train.launch import RanksFailed, launch, should_launch
    from xprep.train.preempt import Stopped
    from xprep.train.trainer import run as run_training

    notes: list[str] = []  # said once the run has passed its checks (an error is one line)
    config = resolve_config(config_file, {"packed": packed, **options}, log=notes.append)
    try:  # start the ranks here (--nproc-per-node), or train in this process (alone, or as a torchrun rank)
        if should_launch(config.parallel.nproc_per_node):
            run_dir = launch(config, notes)
        else:
            run_dir = run_training(config, notes=notes)
    except RanksFailed as e:
        if not e.said:  # rank 0 said it already (--max-bad-steps)
            click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except Stopped as e:  # a signal: checkpointed and stopped (the run said where), or stopped before training
        if not e.said:
            click.echo(str(e), err=True)
        sys.exit(e.exit_code)
    click.echo(f"run written to {run_dir}", err=True)


@xtrain.command()
@click.argument("run_dir", metavar="RUN")
@click.option("--step", type=int, default=None, help="Checkpoint step to export [default: the latest].")
@click.option("-o", "--output", required=True, help="Output directory (must not exist or be empty).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
              help="Weight dtype written (the run's master weights are fp32).")
@_user_errors
def export(run_dir, step, output, dtype):
    """Write the built-in model of run RUN as model.safetensors + config.json for transformers' from_pretrained."""
    from xprep.train.hf_weights import export_run  # torch: deferred, `xprep` never needs it

    out = export_run(run_dir, step, output, dtype)
    click.echo(f"model written to {out}", err=True)


if __name__ == "__main__":
    # `python -m cli xtrain run ...` reaches xtrain; anything else is xprep.
    if len(sys.argv) > 1 and sys.argv[1] == "xtrain":
        sys.argv.pop(1)
        xtrain()
    xprep()
