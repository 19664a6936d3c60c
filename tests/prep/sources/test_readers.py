"""prep/sources/readers/: the registry of input formats, and a format added from outside the package (a tab-separated
file with a ``text`` column, written here as the recipe says) read and tokenized end to end."""

from __future__ import annotations

import csv
import io
import json

import pytest
from prepkit import write_jsonl, xprep_invoke
from xprep.prep.errors import XprepError
from xprep.prep.fs import open_binary
from xprep.prep.sources import READERS, ROWS, RawBatch, Reader, plan_shard, read_batches, register, resolve_inputs
from xprep.prep.sources.readers import expected_names, reader_named


class TsvReader(Reader):
    """Tab-separated values with a header line: each row a record whose fields are the columns."""

    name = "tsv"
    suffixes = (".tsv",)

    @classmethod
    def read(cls, a, src, sizes):
        with open_binary(src.path) as f:
            rows = csv.DictReader(io.TextIOWrapper(f, encoding="utf-8", newline=""), delimiter="\t")
            items, numbers = [], []
            for row in rows:
                items.append(row)
                numbers.append(rows.line_num)  # the row's line in the file, for error messages
                if len(items) >= sizes.batch_records:
                    yield RawBatch(a.source, items, numbers, ROWS)
                    items, numbers = [], []
            if items:
                yield RawBatch(a.source, items, numbers, ROWS)
        return 0


@pytest.fixture
def tsv():
    """The TSV format, registered for one test (and forgotten after it)."""
    register(TsvReader)
    yield TsvReader
    del READERS[TsvReader.name]


TEXTS = ["the quick brown fox", "jumps over the lazy dog", "hello world, again"]


def _write_tsv(path, texts):
    path.write_text("id\ttext\n" + "".join(f"{i}\t{t}\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def test_a_registered_format_is_tokenized_end_to_end_like_json_lines(tmp_path, tiny_tokenizer, tsv):
    """The same records as TSV and as JSON Lines give the same token streams; the manifest records the file."""
    table = _write_tsv(tmp_path / "a.tsv", TEXTS)
    lines = write_jsonl(tmp_path / "a.jsonl", [{"id": str(i), "text": t} for i, t in enumerate(TEXTS)])
    for source, out in ((table, "from-tsv"), (lines, "from-jsonl")):
        result = xprep_invoke("tokenize", source, "-o", tmp_path / out, "--tokenizer", tiny_tokenizer)
        assert result.exit_code == 0, result.output
    for name in ("tokens.bin", "tokens.idx"):
        assert (tmp_path / "from-tsv" / name).read_bytes() == (tmp_path / "from-jsonl" / name).read_bytes()
    manifest = json.loads((tmp_path / "from-tsv" / "manifest.json").read_text())
    assert [s["path"] for s in manifest["sources"]] == [str(table)]
    assert manifest["counts"]["documents"] == len(TEXTS)


def test_a_registered_format_is_found_in_directories_and_named_in_messages(tmp_path, tsv):
    _write_tsv(tmp_path / "b.tsv", TEXTS)
    (tmp_path / "notes.md").write_text("not read")
    (src,) = resolve_inputs([str(tmp_path)])
    assert src.reader is TsvReader and src.kind == "tsv" and not src.splittable
    batches = list(read_batches([src], plan_shard([src], 1, 0)))
    assert [(b.items[k]["text"], b.lines[k]) for b in batches for k in range(len(b.items))] == [
        (t, i + 2) for i, t in enumerate(TEXTS)]
    assert expected_names().endswith(", .arrow or .tsv")
    with pytest.raises(XprepError, match=r"unsupported file type; expected .*\.tsv"):
        resolve_inputs([str(tmp_path / "notes.md")])


def test_without_its_reader_a_format_is_unsupported(tmp_path):
    path = _write_tsv(tmp_path / "c.tsv", TEXTS)
    with pytest.raises(XprepError, match=r"unsupported file type; expected \.jsonl/\.json/\.ndjson\(\.gz/\.zst\), "
                                         r"\.txt, \.parquet or \.arrow$"):
        resolve_inputs([str(path)])
    with pytest.raises(XprepError, match=r"holds no .* file \(it holds 1 file \(1 \.tsv\)\)"):
        resolve_inputs([str(tmp_path)])


def test_the_built_in_formats_keep_their_names():
    """The names are recorded in the keys of tokenize --ray's shards: renaming one would orphan every staged shard."""
    assert list(READERS)[:5] == ["lines", "array", "text", "parquet", "arrow"]
    assert reader_named("parquet") is READERS["parquet"]
    with pytest.raises(XprepError, match="unknown input format 'csv'; known: lines, array, text, parquet, arrow"):
        reader_named("csv")


def test_a_reader_needs_a_name_of_its_own_and_a_suffix(tsv):
    class Again(TsvReader):
        pass

    class Nameless(Reader):
        suffixes = (".x",)

    with pytest.raises(ValueError, match="input format 'tsv' is TsvReader's already"):
        register(Again)
    with pytest.raises(TypeError, match="needs a name"):
        register(Nameless)
    assert register(TsvReader) is TsvReader  # registering the same class twice is harmless


def test_the_last_registered_reader_that_recognises_the_content_reads_it(tmp_path):
    """Where several readers claim a name, content decides: a ``.json`` array is the array reader's, JSON Lines stay
    the lines reader's, and a reader registered later that recognises a file is asked first."""

    class Marked(Reader):
        name = "marked-json"
        suffixes = (".json",)

        @classmethod
        def recognises(cls, src):
            with open_binary(src.path) as f:
                return f.read(7) == b'{"mark"'

    (tmp_path / "a.json").write_text('[{"text": "x"}]')
    (tmp_path / "b.json").write_text('{"text": "x"}\n')
    (tmp_path / "c.json").write_text('{"mark": 1}\n')
    assert [s.kind for s in resolve_inputs([str(tmp_path)])] == ["array", "lines", "lines"]
    register(Marked)
    try:
        assert [s.kind for s in resolve_inputs([str(tmp_path)])] == ["array", "lines", "marked-json"]
    finally:
        del READERS[Marked.name]
