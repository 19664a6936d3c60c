"""Golden outputs: the bytes of datasets, the cache keys and arrays of pack entries, and the losses of a short run,
pinned for real inputs (the Qwen3 and Mistral tokenizers, State of the Union addresses, chitchat conversations).

Refactors must leave these unchanged: a moved module, a renamed option or a new registry that alters a single byte of
what ``xprep tokenize`` writes, a cache key (every user's pack cache would be rebuilt) or the data a run trains on
fails here. A deliberate format change updates the pins in the same commit and says why.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import requires_shared_data

pytestmark = requires_shared_data

N_ADDRESSES = 30  # State of the Union addresses, in name order
N_CONVERSATIONS = 400  # chitchat lines

# tokens.bin / tokens.idx / loss_mask.* → sha256[:16]; "fingerprint" → the manifest's
GOLDEN_DATASETS = {
    "text": {
        "tokens.bin": "6fcfde9a27f520e3",
        "tokens.idx": "f05618d761fafc8f",
        "fingerprint": "1faec806f026a72575419572ee628fb1e5c0dab8c4cc44f1ca33a27c1949b8f1"
    },
    "chat": {
        "loss_mask.bin": "0ba1f1d96fec8dfa",
        "loss_mask.idx": "5c5294d72cdc0e75",
        "tokens.bin": "40991fcfb26eee57",
        "tokens.idx": "d11aabd72d627e3e",
        "fingerprint": "4dffc0c1cf88aa83b5499c2398ec2121e34b6427e5f73652ed9fc4aa19303f8f"
    },
    "mistral": {
        "tokens.bin": "64c01a2a7822dad4",
        "tokens.idx": "da85af9c8d586322",
        "fingerprint": "acf5f0bafe07701d9ac995d65b47f556d653565d252f019b3094275d6058b459"
    }
}
# pack name → entry name → {"key": cache key, "bins", file → sha256[:16]}
GOLDEN_PACKS = {
    "chunk": {
        "chunk-1479acf739a72548": {
            "key": "1479acf739a725484336a0befe6f5397097c1a81e1f3006b05016e516e5e73a2",
            "bins": 280,
            "bin_offsets.npy": "edef9021a25a188b",
            "bin_targets.npy": "ab970fe976bea9e3",
            "item_doc.npy": "5a475cc520fb00e0",
            "item_len.npy": "f75ff750fd5a506d",
            "item_start.npy": "1a3458f069068e82"
        }
    },
    "multipack": {
        "multipack-2961445972c4d203": {
            "key": "2961445972c4d203e069e9260f65b024e9a82daa0c55d4bf6c5b58e2e9ca725c",
            "bins": 141,
            "bin_offsets.npy": "2876c6992e7c5f20",
            "bin_targets.npy": "bb2fe4473a27f0bd",
            "item_doc.npy": "ca99fab6850ce240",
            "item_len.npy": "32cc239f6a6bc0e5",
            "item_start.npy": "58004d5e40ae3253"
        }
    },
    "sequential": {
        "sequential-9215e05554ec13ab": {
            "key": "9215e05554ec13ab8828960925b2dafb9f48b88e315c6b2bd86f62bccf4e26c0",
            "bins": 180,
            "bin_offsets.npy": "3e331fee015474ee",
            "bin_targets.npy": "e74cb53c49d0717b",
            "item_doc.npy": "fe619c635e481906",
            "item_len.npy": "c3ed777a28a8a1de",
            "item_start.npy": "9ea1a9aa5171d841"
        }
    },
    "token-aware": {
        "token-aware-5025dfdccdf598e5": {
            "key": "5025dfdccdf598e5c30f1690c9f7aeb93968af9cd2f58766b08cfd4840d7779e",
            "bins": 81,
            "bin_offsets.npy": "35c3fe8016dc2bfb",
            "bin_targets.npy": "b5c4457c1435a70b",
            "item_doc.npy": "580599b8c48dccc7",
            "item_len.npy": "354abf8947546a92",
            "item_start.npy": "f9e1878ffd05743b"
        }
    },
    "blend": {
        "blend-93d46ed01ad25ad7": {
            "key": "93d46ed01ad25ad76658b897d1a625069644550398d2da1773393f9032bc6256",
            "bins": 86,
            "bin_index.npy": "8f2ac0e80b1990d6",
            "bin_source.npy": "cd71e287a7432993"
        },
        "blend-b0a7dc464d92bab9": {
            "key": "b0a7dc464d92bab91343a64f331815e1a4241a20e2e110104d9f4b1b69b20d89",
            "bins": 14,
            "bin_index.npy": "1b3873fbda58b56c",
            "bin_source.npy": "9a8a9c73bb22e813"
        }
    }
}
GOLDEN_LOSSES = [10.373327812179923, 10.374290756881237, 10.372959243133664, 10.368787748739123]

PACKS = {
    "sequential": ["--method", "sequential", "--seq-len", "2048"],
    "multipack": ["--method", "multipack", "--seq-len", "2048", "--overlong", "split"],
    "token-aware": ["--method", "token-aware", "--max-tokens", "4096", "--overlong", "truncate"],
    "chunk": ["--method", "chunk", "--seq-len", "1024"],
}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def invoke(group, *args):
    result = CliRunner().invoke(group, list(map(str, args)), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def golden(tmp_path_factory, shared_data):
    """The datasets and packs of the pinned commands, built once for the module."""
    from xprep import cli

    root = tmp_path_factory.mktemp("golden")
    addresses = root / "sotu"
    addresses.mkdir()
    for path in sorted((shared_data / "corpora" / "sotu").iterdir())[:N_ADDRESSES]:
        shutil.copy(path, addresses / path.name)
    chat = root / "chat.jsonl"
    with open(shared_data / "chat" / "chitchat.jsonl", encoding="utf-8") as f:
        chat.write_text("".join(next(f) for _ in range(N_CONVERSATIONS)), encoding="utf-8")
    qwen3 = shared_data / "tokenizers" / "qwen3"
    invoke(cli.xprep, "tokenize", addresses, "-o", root / "text", "--tokenizer", qwen3, "--eod-token", "<|endoftext|>")
    invoke(cli.xprep, "tokenize", chat, "-o", root / "chat", "--tokenizer", qwen3)
    invoke(cli.xprep, "tokenize", addresses, "-o", root / "mistral", "--tokenizer",
           shared_data / "tokenizers" / "mistral")
    return root


def dataset_digests(path: Path) -> dict:
    out = {p.name: digest(p) for p in sorted(path.iterdir()) if p.suffix in (".bin", ".idx")}
    out["fingerprint"] = json.loads((path / "manifest.json").read_text())["fingerprint"]
    return out


def entry_digests(packed: Path) -> dict:
    """Every entry of the pack's manifest (a blend's own and its sources', a split's two parts)."""
    manifest = json.loads((packed / "manifest.json").read_text())
    out = {}
    for name, entry in sorted(manifest["entries"].items()):
        files = {p.name: digest(p) for p in sorted((packed / name).iterdir()) if p.suffix == ".npy"}
        out[name] = {"key": entry["key"], "bins": entry["bins"], **files}
    return out


@pytest.mark.parametrize("name", ["text", "chat", "mistral"])
def test_datasets_are_byte_identical(golden, name):
    assert dataset_digests(golden / name) == GOLDEN_DATASETS.get(name), json.dumps(dataset_digests(golden / name))


@pytest.mark.parametrize("method", sorted(PACKS))
def test_pack_entries_keep_their_keys_and_bytes(golden, method):
    from xprep import cli

    packed = golden / f"pack-{method}"
    invoke(cli.xprep, "pack", golden / "text", golden / "chat", "-o", packed, *PACKS[method])
    assert entry_digests(packed) == GOLDEN_PACKS.get(method), json.dumps(entry_digests(packed))


def test_a_blend_with_a_split_keeps_its_keys_and_bytes(golden):
    from xprep import cli

    packed = golden / "pack-blend"
    invoke(cli.xprep, "pack", f"{golden / 'text'}@0.7", f"{golden / 'chat'}@0.3", "-o", packed, "--method",
           "multipack", "--seq-len", "2048", "--overlong", "split", "--split", "9,1")
    assert entry_digests(packed) == GOLDEN_PACKS.get("blend"), json.dumps(entry_digests(packed))


def test_a_short_run_trains_on_the_same_data(golden, tmp_path):
    """fp32 on the CPU, one process: the losses of 4 steps on the Mistral chunk pack. The tolerance absorbs the
    CPU's summation order on another machine; a different batch moves the loss by far more."""
    from xprep import cli

    packed = golden / "pack-mistral"
    invoke(cli.xprep, "pack", golden / "mistral", "-o", packed, "--method", "chunk", "--seq-len", "256")
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"vocab_size": 32000, "dim": 32, "n_layers": 1, "n_heads": 2}))
    run = tmp_path / "run"
    invoke(cli.xtrain, "run", packed, "--model", model, "--steps", "4", "--micro-batch-size", "2", "--seed", "3",
           "--sampler", "random", "-o", run, "--log-every", "100")
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert losses == pytest.approx(GOLDEN_LOSSES, rel=1e-6), losses
