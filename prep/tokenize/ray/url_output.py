"""The output of ``xprep tokenize --ray -o URL`` as a sharded dataset at the URL (prep/dataset/sharded.py), written
without funnelling a token byte through the driver.

Tasks upload their shards into the staging area beside the output (``URL.xprep-shards``, ray/staging.py) as they
finish. As soon as the shards before it are placed too, each is copied inside the store (a server-side copy on S3)
to ``URL/shard-NNNNN/``, its rejects renumbered to whole files' lines, and its ``COMPLETE`` marker written last, so
it is an ordinary dataset at a URL. Once every shard is placed, the sharded manifest is uploaded, then its own
``COMPLETE`` marker: object stores have no rename, so publishing is this order, and a reader (which needs the
marker) never meets a manifest naming a shard that is not whole.
"""

from __future__ import annotations

import json

from xprep.prep.dataset import KEPT_TOKENIZER, check_output_url, mark_complete, publish_sharded_url
from xprep.prep.errors import XprepError
from xprep.prep.formats import MANIFEST, REJECTS
from xprep.prep.fs import filesystem
from xprep.prep.tokenize.ray.staging import ShardDone, Staging


def shard_name(k: int) -> str:
    """The directory of shard ``k`` in a sharded dataset ``--ray`` writes (local or at a URL)."""
    return f"shard-{k:05d}"


class ShardedURLOutput:
    """The sharded dataset at ``url``, built shard by shard as results come (``sync``), published by ``finish``.

    ``line_shift(k)``: the lines to add to shard ``k``'s rejects, per source path (needs the results of the shards
    before it: shards are placed in order)."""

    def __init__(self, url: str, line_shift):
        self.url = url.rstrip("/")
        self.fs, self.inner = filesystem(self.url)
        self.line_shift = line_shift
        self.placed = 0  # shards 0..placed-1 are whole at the URL

    def __enter__(self) -> ShardedURLOutput:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        pass

    def sync(self, keys: list[str], results: dict[int, ShardDone], staging: Staging) -> None:
        """Place every finished shard whose predecessors are placed (called after each result)."""
        while self.placed in results:
            self._place(self.placed, staging.shard_url(keys[self.placed]), results)
            self.placed += 1

    def _place(self, k: int, source: str, results: dict[int, ShardDone]) -> None:
        """Copy the staged shard at ``source`` to ``URL/shard-k`` (inside the store), its rejects renumbered, its
        marker last."""
        fs, src = filesystem(source)
        dst = f"{self.inner}/{shard_name(k)}"
        manifest = None
        try:
            for path in sorted(fs.ls(src, detail=False)):
                name = path.rstrip("/").rsplit("/", 1)[-1]
                if name == REJECTS:
                    fs.pipe_file(f"{dst}/{name}", shifted_rejects(fs.cat_file(path), self.line_shift(k)))
                elif name == MANIFEST:
                    manifest = json.loads(fs.cat_file(path))
                    fs.copy(path, f"{dst}/{name}")
                else:
                    fs.copy(path, f"{dst}/{name}")
            if manifest is None:
                raise XprepError(f"{source}: a finished shard without its {MANIFEST}; run the command again")
            mark_complete(fs.unstrip_protocol(dst), manifest["fingerprint"])
        except OSError as e:
            raise XprepError(f"-o {self.url}: placing shard {k + 1} failed ({type(e).__name__}: {e}); run the "
                             "command again (finished shards are reused)") from None

    def finish(self, extra: dict, kept_tokenizer: str | None, shards: int) -> dict:
        """Publish the sharded dataset over the ``shards`` placed shards: its manifest, then its marker
        (``publish_sharded_url``); returns the manifest. ``extra``: fields to add (the run's ``sources``; with
        ``kept_tokenizer``, the file uploaded beside the manifest first, its ``tokenizer`` entry)."""
        if self.placed != shards:
            raise XprepError(f"-o {self.url}: {shards - self.placed} shards were never placed; run the command again")
        check_output_url(self.url)  # still free: nothing else published there meanwhile
        if kept_tokenizer is not None:
            try:
                self.fs.put_file(kept_tokenizer, f"{self.inner}/{KEPT_TOKENIZER}")
            except OSError as e:
                raise XprepError(f"-o {self.url}: the upload failed ({type(e).__name__}: {e}); run the command "
                                 "again (finished shards are reused)") from None
        return publish_sharded_url(self.url, [shard_name(k) for k in range(shards)], extra)


def shifted_rejects(rejects: bytes, shift: dict[str, int]) -> bytes:
    """A shard's rejects.jsonl with its line numbers made whole files' (``shift``: lines to add per source)."""
    out = []
    for line in rejects.decode("utf-8").splitlines():
        r = json.loads(line)
        if r["line"]:  # 0: the whole file
            r["line"] += shift.get(r["source"], 0)
        out.append(json.dumps(r, ensure_ascii=False) + "\n")
    return "".join(out).encode("utf-8")
