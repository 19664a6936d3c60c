"""Token datasets: Megatron ``.bin/.idx`` streams, the manifest, merging, and datasets at URLs. Imports nothing of the
other stages.

What other stages (and train/, cli.py) may import is what this file exports; inside the stage, modules
import each other directly.
"""

from xprep.prep.dataset.chunks import stream_chunks
from xprep.prep.dataset.indexed import bin_path, idx_path
from xprep.prep.dataset.manifest import (
    CONVERSATION_COUNTS,
    KEPT_TOKENIZER,
    MAX_CATEGORY,
    CategoryTable,
    canonical_json,
    conversation_counts,
    count,
    dataset_tokenizer,
    is_sharded,
    read_manifest,
    token_dtype,
    verify_streams,
)
from xprep.prep.dataset.merge import append_dataset, merge_datasets
from xprep.prep.dataset.remote import (
    FetchProcess,
    check_output_url,
    mark_complete,
    read_complete_manifest,
    read_item_ranges,
    staged_copy,
    sync_dataset,
    synced_from,
    upload_dataset,
)
from xprep.prep.dataset.sharded import (
    ShardedDataset,
    open_dataset,
    open_parts,
    open_url_parts,
    publish_sharded_url,
    verify_parts,
    write_sharded,
)
from xprep.prep.dataset.stream import (
    COALESCE_GAP,
    DEFAULT_CACHE_SIZE,
    DEFAULT_RETRY_S,
    BlockCache,
    Retry,
    StreamedDataset,
    StreamUnavailable,
    open_block_cache,
)
from xprep.prep.dataset.token_dataset import DatasetWriter, TokenDataset, check_token_ids

__all__ = [
    "BlockCache", "COALESCE_GAP", "CONVERSATION_COUNTS", "CategoryTable", "DEFAULT_CACHE_SIZE", "DEFAULT_RETRY_S",
    "DatasetWriter", "FetchProcess", "KEPT_TOKENIZER", "MAX_CATEGORY", "Retry", "ShardedDataset", "StreamUnavailable",
    "StreamedDataset", "TokenDataset", "append_dataset", "bin_path", "canonical_json", "check_output_url",
    "check_token_ids", "conversation_counts", "count", "dataset_tokenizer", "idx_path", "is_sharded", "mark_complete",
    "merge_datasets", "open_block_cache", "open_dataset", "open_parts", "open_url_parts", "publish_sharded_url",
    "read_complete_manifest", "read_item_ranges", "read_manifest", "staged_copy", "stream_chunks", "sync_dataset",
    "synced_from", "token_dtype", "upload_dataset", "verify_parts", "verify_streams", "write_sharded"
]
