"""What ``xprep tokenize`` takes (``TokenizeConfig``: one field per option, checked), and what a Processor needs of
it (``Options``: the options that define the dataset's content, and so its fingerprint)."""

from __future__ import annotations

from dataclasses import dataclass, field

from xprep.prep.chat import CHAT_RENDERS
from xprep.prep.dataset import CategoryTable
from xprep.prep.errors import XprepError
from xprep.prep.formats import AUTO, CHAT, MASK_CONVENTIONS, RECORD_FORMATS, TARGET, TEXT

WORKER_STARTS = ("fork", "spawn")  # --worker-start: fork where it is safe (else spawn), or always spawn


@dataclass
class TokenizeConfig:
    """Everything ``xprep tokenize`` takes; one field per CLI option."""

    inputs: list[str]
    output: str
    tokenizer: str
    format: str = AUTO
    text_field: str = "text"
    chat_template: str = "auto"
    train_on: str = "assistant"
    category: str | None = None
    category_field: str | None = None
    mask_convention: str = TARGET  # --mask-convention: what a pre-tokenized record's loss_mask means (prep.formats)
    category_names: str | None = None  # --category-names: a JSON file naming pre-tokenized records' category ids
    append_eod: bool | None = None
    workers: int = 0
    backend: str = "auto"
    dtype: str = "auto"
    num_shards: int = 1
    shard_index: int = 0
    on_error: str = "fail"
    limit: int | None = None
    eod_token: str | None = None
    bos_token: str | None = None
    role_map: str | None = None
    allow_empty: bool = False
    progress_every: float = 30.0  # seconds between progress lines when stderr is not a terminal; 0 = none
    ray: str | None = None  # --ray: "auto" or HOST:PORT of a Ray cluster to run the shards on (tokenize/ray/cluster.py)
    shard_size: int = 256 * 10**6  # --shard-size: bytes of input per Ray task
    max_retries: int = 3  # --max-retries: of a Ray task lost with its worker or node
    merge: bool = False  # --merge: --ray publishes one merged dataset, not a sharded one
    cache_dir: str | None = None  # --cache-dir: converted tokenizers and tokenizer facts (None: prep.fs.cache_root's)
    # --chat-render: which chat renderer runs (xprep.prep.chat.CHAT_RENDERS); the output is the same whichever
    # does, so it is in no fingerprint, manifest field or cache key
    chat_render: str = "auto"
    worker_start: str = "fork"  # --worker-start: how worker processes start (pool.py); the output is the same

    def __post_init__(self) -> None:
        if self.format not in RECORD_FORMATS:
            raise XprepError(f"--format {self.format}: expected one of {', '.join(RECORD_FORMATS)}")
        if self.chat_render not in CHAT_RENDERS:
            raise XprepError(f"--chat-render {self.chat_render}: expected one of {', '.join(CHAT_RENDERS)}")
        if self.mask_convention not in MASK_CONVENTIONS:
            raise XprepError(f"--mask-convention {self.mask_convention}: expected one of {', '.join(MASK_CONVENTIONS)}")
        for option, given in (("--mask-convention prediction", self.mask_convention != TARGET),
                              (f"--category-names {self.category_names}", self.category_names is not None)):
            if given and self.format in (TEXT, CHAT):
                raise XprepError(f"{option} is for pre-tokenized records, which --format {self.format} never reads: "
                                 "use --format tokens (or auto), or leave the option out")
        if self.worker_start not in WORKER_STARTS:
            raise XprepError(f"--worker-start {self.worker_start}: expected one of {', '.join(WORKER_STARTS)}")
        if self.num_shards < 1:
            raise XprepError(f"--num-shards {self.num_shards}: must be ≥ 1")
        if not 0 <= self.shard_index < self.num_shards:
            raise XprepError(
                f"--shard-index {self.shard_index}: must be in [0, {self.num_shards - 1}] for "
                f"--num-shards {self.num_shards}"
            )
        if self.workers < 0:
            raise XprepError(f"--workers {self.workers}: must be ≥ 0 (0 = auto)")
        if self.limit is not None and self.limit < 1:
            raise XprepError(f"--limit {self.limit}: must be ≥ 1")
        if self.progress_every < 0:
            raise XprepError(f"--progress-every {self.progress_every}: must be ≥ 0 seconds (0 = no progress lines)")
        if self.ray is not None:
            if self.num_shards > 1:
                raise XprepError("--ray plans its own shards: leave out --num-shards/--shard-index (they are the "
                                 "route without a cluster, e.g. Slurm arrays + xprep merge)")
            if self.limit is not None:
                raise XprepError("--limit reads the first N records in order, which a cluster does not: try the "
                                 "command without --ray")
            if self.max_retries < 0:
                raise XprepError(f"--max-retries {self.max_retries}: must be ≥ 0")
        elif self.merge:
            raise XprepError("--merge is for --ray (whose shards it merges); a run without --ray writes one dataset")


@dataclass(frozen=True)
class Options:
    """What a Processor needs besides the tokenizer: content-defining options only."""

    format: str
    text_field: str
    train_on: str
    category: str | None
    category_field: str | None
    append_eod: bool | None  # None: plain text documents only
    eod_id: int | None
    vocab_size: int
    role_map: dict[str, str] = field(default_factory=dict)  # --role-map, on top of xprep.prep.chat's ROLES
    mask_convention: str = TARGET  # --mask-convention
    category_names: dict[int, str] = field(default_factory=dict)  # --category-names, read: id → name

    def describe(self) -> dict:
        described = {"format": self.format, "text_field": self.text_field, "train_on": self.train_on,
                     "category": self.category, "category_field": self.category_field,
                     "append_eod": self.append_eod}
        # each only when given: datasets made without them keep their fingerprints (an absent one is the default)
        if self.role_map:
            described["role_map"] = dict(sorted(self.role_map.items()))
        if self.mask_convention != TARGET:
            described["mask_convention"] = self.mask_convention
        if self.category_names:
            described["category_names"] = {str(cid): name for cid, name in sorted(self.category_names.items())}
        return described

    def category_table(self) -> CategoryTable:
        """The empty category table a run's categories are registered in: it names numeric ids as
        ``--category-names`` does."""
        return CategoryTable(numeric_names=self.category_names)

