"""``xprep pack``: its config, the packing methods (one registry: methods.py) and their numba kernels, chunked packs,
blends and mixtures, the entry format and the cache. Uses dataset.

What other stages (and train/, cli.py) may import is what this file exports; inside the stage, modules
import each other directly.
"""

from xprep.prep.pack.cache import PackConfig, pack
from xprep.prep.pack.config import check_chunk_cp, parse_sources, parse_split
from xprep.prep.pack.entry import MANIFEST, PACK_JSON, DatasetChanged, PackEntry
from xprep.prep.pack.kernels import range_bincount
from xprep.prep.pack.methods import (
    PackingMethod,
    method_names,
    methods_of,
    packing_method,
    packing_methods,
    register_method,
    unregister_method,
)
from xprep.prep.pack.mixture import BlendEntry, open_entry
from xprep.prep.pack.reader import PackBins, doc_lengths
from xprep.prep.pack.remote import fetch_pack

__all__ = [
    "BlendEntry", "DatasetChanged", "MANIFEST", "PACK_JSON", "PackBins", "PackConfig", "PackEntry", "PackingMethod",
    "check_chunk_cp", "doc_lengths", "fetch_pack", "method_names", "methods_of", "open_entry", "pack", "packing_method",
    "packing_methods", "parse_sources", "parse_split", "range_bincount", "register_method", "unregister_method"
]
