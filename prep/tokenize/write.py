"""A run's records → its dataset: every batch through the pool, appended in input order; bad records failed on or
set aside (``--on-error``); a run that yields nothing refused."""

from __future__ import annotations

import numpy as np
from xprep.prep.dataset import CategoryTable, DatasetWriter, count
from xprep.prep.errors import XprepError
from xprep.prep.formats import REJECTS
from xprep.prep.progress import Progress
from xprep.prep.sources import Unreadable, read_batches
from xprep.prep.tokenize.config import TokenizeConfig
from xprep.prep.tokenize.job import planned_bytes
from xprep.prep.tokenize.pool import Pipeline
from xprep.prep.tokenize.records import Rejected


def write_all(config: TokenizeConfig, sources, plan, writer: DatasetWriter, pipeline: Pipeline,
              lines_read: list[int] | None = None, progress: Progress | None = None,
              categories: CategoryTable | None = None) -> CategoryTable:
    """Feed every batch of the shard through ``pipeline`` and append the results in input order.

    ``lines_read`` gets the lines each assignment read (see ``read_batches``); ``categories``, the table to register
    the categories in (``Options.category_table``; default: one naming numeric ids by their number)."""
    categories = categories if categories is not None else CategoryTable()
    if progress is None:
        progress = Progress("tokenize", total_bytes=planned_bytes(sources, plan), interval=config.progress_every)
    ok = False
    try:
        for result in pipeline.map(read_batches(sources, plan, config.limit, lines_read)):
            if isinstance(result, Unreadable):
                if result.cut_short:  # records were lost: not one bad record that --on-error skip could set aside
                    raise CutShort(sources[result.source].path, result, config.on_error)
                rejected = Rejected(result.line, "unreadable file", result.reason, None, fatal=True)
                _reject(writer, config.on_error, sources[result.source].path, rejected)
                continue
            for rejected in result.rejects:
                _reject(writer, config.on_error, sources[result.source].path, rejected)
            lut = _category_lut(categories, result.cat_keys, result.cat_codes)
            cats = lut[result.cat_codes] if result.cat_codes is not None else None
            writer.append(result.tokens, result.lengths, result.loss_mask, cats)
            writer.add_conversations(result.conversations)
            progress.update(len(result.lengths), len(result.tokens), result.bytes_in)
        ok = True
    finally:
        pipeline.close(ok)
        progress.close()
    return categories


def check_not_empty(config: TokenizeConfig, writer: DatasetWriter) -> None:
    """A run that yields no document, or nothing to train on, is a mistake unless ``--allow-empty`` says otherwise."""
    if config.allow_empty:
        return
    counts = writer.counts
    where = f"{', '.join(config.inputs)}"
    if config.num_shards > 1:
        where += f" (shard {config.shard_index} of {config.num_shards})"
    if counts.documents == 0:
        kinds = ", ".join(f"{n:,} × {kind}" for kind, n in sorted(writer.reject_reasons.items(), key=lambda kv: -kv[1]))
        rejected = ("" if not writer.reject_count else f"; the one record was rejected ({kinds})"
                    if writer.reject_count == 1 else f"; all {writer.reject_count:,} records were rejected ({kinds})")
        raise XprepError(f"{where}: no document to write{rejected}; nothing was published "
                         "(pass --allow-empty to write an empty dataset anyway)")
    if counts.loss_tokens == 0:
        raise XprepError(f"{where}: {count(counts.documents, 'document')} but not one target token (each document's "
                         "first token is never a target, chat targets only assistant turns); nothing was published "
                         "(check --tokenizer and --train-on, or pass --allow-empty)")


class BadInput(XprepError):
    """A fatal bad record under ``--on-error fail``: where it is and why, kept apart for the Ray driver,
    which renumbers lines of a shard that counted them from its own start."""

    def __init__(self, path: str, line: int, reason: str):
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {reason} (use --on-error skip to set bad records aside in {REJECTS})")
        self.path, self.line, self.reason = path, line, reason

    def __reduce__(self):
        return BadInput, (self.path, self.line, self.reason)


class CutShort(XprepError):
    """A compressed input that ended early, or broke after records came out of it: the records beyond the point read
    are lost, which no ``--on-error`` mode may pass over as one bad record. Names the file, the error, how many
    records were read and the last of them."""

    def __init__(self, path: str, unreadable: Unreadable, on_error: str):
        reason = unreadable.reason.removeprefix("unreadable file: ")
        read = (f"{count(unreadable.records, 'record')} were read, the last at line {unreadable.last_line:,}"
                if unreadable.records else "no record was read")
        skip = " (--on-error skip sets bad records aside, not a file cut short)" if on_error == "skip" else ""
        super().__init__(f"{path}: the compressed file is cut short or damaged ({reason}): {read}, and what follows "
                         f"was lost; nothing was published{skip}: restore the whole file, or leave it out of the "
                         "inputs")


def _reject(writer: DatasetWriter, on_error: str, path: str, rejected: Rejected) -> None:
    """Fail on a fatal bad record under --on-error fail; otherwise set it aside in rejects.jsonl."""
    if rejected.fatal and on_error == "fail":
        raise BadInput(path, rejected.line, rejected.reason)
    writer.reject(path, rejected.line, rejected.reason, rejected.record, rejected.kind)


def _category_lut(categories: CategoryTable, keys: list, codes: np.ndarray | None) -> np.ndarray:
    """Map a batch's local category codes to dataset ids, registering new names in order of first
    appearance in the token stream (so ids never depend on how a batch was processed)."""
    lut = np.zeros(len(keys), np.uint16)
    if codes is None or not len(codes):
        return lut
    present, first = np.unique(codes, return_index=True)
    in_order = present[np.argsort(first)]
    lut[in_order] = categories.remap([keys[code] for code in in_order.tolist()])
    return lut
