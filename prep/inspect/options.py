"""``xprep inspect``: its options, and what kind of directory a path is.

The command dispatches (cli.py): ``kind_of`` says what each path is, the module that owns that kind of
data builds the report (``prep/inspect/dataset_report.py``, ``prep/inspect/pack_report.py``, ``train/report.py``) and
``prep/inspect/text.py`` turns it into text; ``--json`` prints the report itself (a list of them for several paths),
and ``--html FILE`` draws them all on one page (``prep/inspect/html.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from xprep.prep.errors import XprepError
from xprep.prep.formats import BLEND_JSON, DATASET_FORMAT, MANIFEST, PACK_FORMAT, PACK_JSON, SHARDED_FORMAT
from xprep.prep.fs import is_url
from xprep.prep.inspect.remote import RUN_FILES, url_kind
from xprep.prep.io import read_json

KIND_NAMES = {"dataset": "token dataset", "packed": "pack cache", "run": "run directory"}


@dataclass
class InspectOptions:
    """What ``xprep inspect`` adds to the plain report; one field per option.

    ``sample``/``seed``/``over`` apply to a token dataset, ``plot`` (an image file) to a run directory.
    ``over`` may be given as the option's text, ``"2048,4096"``. ``cache_dir``: where what is fetched of a dataset
    or a pack at a URL is kept (None: ``prep.fs.cache_root``'s).
    """

    sample: int | None = None
    seed: int | None = None
    over: tuple[int, ...] | str | None = None
    plot: str | None = None
    cache_dir: str | None = None

    def __post_init__(self):
        if self.sample is not None and self.sample < 1:
            raise XprepError(f"--sample {self.sample}: ask for at least 1 document")
        if self.seed is not None and self.sample is None:
            raise XprepError(f"--seed {self.seed} applies only with --sample N (it draws the N documents at random)")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise XprepError(f"--seed {self.seed}: use a seed in [0, 2**63)")
        if isinstance(self.over, str):
            self.over = parse_over(self.over)

    def check_applies(self, kind: str, path: str | Path) -> None:
        given = {"--sample": self.sample, "--over": self.over, "--plot": self.plot}
        wanted = {"--sample": "dataset", "--over": "dataset", "--plot": "run"}
        for flag, value in given.items():
            if value is not None and wanted[flag] != kind:
                raise XprepError(f"{flag} applies only to a {KIND_NAMES[wanted[flag]]}, and {path} is a "
                                 f"{KIND_NAMES[kind]}; drop {flag}")


    def check_applies_to(self, found: list[tuple[str, str]]) -> None:
        """Every option given applies to some of the paths (``(path, kind)`` pairs); ``--plot`` draws one run
        directory alone."""
        if len(found) == 1:
            self.check_applies(found[0][1], found[0][0])
            return
        if self.plot is not None:
            raise XprepError(f"--plot draws one run directory, and {len(found)} paths are given; give one, or "
                             "overlay the runs with --html FILE")
        kinds = {kind for _, kind in found}
        for flag, value in (("--sample", self.sample), ("--over", self.over)):
            if value is not None and "dataset" not in kinds:
                raise XprepError(f"{flag} applies only to a token dataset, and none of the {len(found)} paths is "
                                 f"one; drop {flag}")


def parse_over(text: str) -> tuple[int, ...]:
    """``"8192,2048"`` → ``(2048, 8192)``: sorted, distinct, positive token counts."""
    try:
        lengths = sorted({int(part.replace("_", "")) for part in text.split(",")})
    except ValueError:
        raise XprepError(f"--over {text}: expected comma-separated token counts, e.g. --over 2048,4096,8192") from None
    if lengths[0] < 1:
        raise XprepError(f"--over {text}: lengths must be positive numbers of tokens")
    return tuple(lengths)


def kind_of(path: str | Path) -> str:
    """What ``path`` is: "dataset", "packed" or "run"; anything else is a clear error. A URL is looked at where it
    is (``url_kind``; a run directory there is refused)."""
    if is_url(str(path)):
        return url_kind(str(path))
    path = Path(path)
    if not path.exists():
        raise XprepError(f"{path}: no such file or directory")
    manifest = path / MANIFEST
    if manifest.is_file():
        data = read_json(manifest, "manifest", "the directory is corrupt: re-create it")
        if not isinstance(data, dict):
            raise XprepError(f"{manifest}: not a JSON object; the directory is corrupt: re-create it")
        fmt = data.get("format")
        if fmt in (DATASET_FORMAT, SHARDED_FORMAT):
            return "dataset"
        if fmt == PACK_FORMAT:
            return "packed"
    if (path / PACK_JSON).is_file() or (path / BLEND_JSON).is_file():  # one entry of a cache, plain or a blend
        return "packed"
    if any((path / name).is_file() for name in RUN_FILES):
        return "run"
    raise XprepError(f"{path}: neither a token dataset, a pack cache nor a run directory")
