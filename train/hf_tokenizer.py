"""The tokenizer a Hugging Face export ships: the one the run's data was encoded with (``data_tokenizer``).

```
run.json → the pack entry trained on → each dataset's manifest.json → the tokenizer.json it records (sha256 checked)
                                                                    + tokenizer_config.json, chat template the data's
```
Found through the data, never guessed: the model learned the ids of that tokenizer, so an export with another one
would decode wrongly without a word. Where it is not found, ``xprep.train.hf_weights`` says so and exports the
weights alone. A module of its own beside hf_weights.py (the weights in and out): this is the data's side, read
through prep/'s manifests and pack entries.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from xprep.prep.chat import BUILTIN_TEMPLATES
from xprep.prep.errors import XprepError
from xprep.prep.formats import BLEND_JSON, MANIFEST, PACK_JSON
from xprep.prep.io import file_sha256, read_json
from xprep.prep.pack import open_entry

TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"


@dataclass(frozen=True)
class DataTokenizer:
    """The tokenizer a run's datasets were encoded with, as an export writes it."""

    path: Path  # the tokenizer.json; its sha256 is the one the datasets' manifests record
    sha256: str
    config: dict  # the tokenizer_config.json to write (the one beside ``path``, or one built from the manifest)
    copied: tuple[Path, ...]  # further files from beside ``path`` (special_tokens_map.json)
    token_ids: dict[str, int]  # eos/bos/pad_token_id for config.json, from the manifest
    said: str  # where it came from and which chat template it has, for the console

    def write(self, out: Path) -> str:
        """Copy the tokenizer into ``out``, checking the copy against the recorded sha256; the console line."""
        shutil.copyfile(self.path, out / TOKENIZER_JSON)
        if file_sha256(out / TOKENIZER_JSON, "check the disk") != self.sha256:
            raise XprepError(f"{self.path}: changed while it was copied (its sha256 is no longer the one the data "
                             "was tokenized with); run the export again once nothing writes it")
        (out / TOKENIZER_CONFIG).write_text(json.dumps(self.config, indent=2, ensure_ascii=False) + "\n")
        for path in self.copied:
            shutil.copyfile(path, out / path.name)
        return self.said


def data_tokenizer(run: str | Path, pack_key: str | None = None) -> DataTokenizer:
    """The tokenizer ``run``'s data was encoded with: run.json → the pack entry it trained on (the one with
    ``pack_key``, the checkpoint's) → each dataset's manifest.json → the tokenizer.json it records (its
    ``tokenizer.path``, relative to the dataset when not absolute, or a copy kept in the dataset as tokenizer.json),
    taken only where its sha256 is the recorded one.

    The tokenizer_config.json beside that file comes along, its chat template set to the one the chat data was
    rendered with (the manifest's ``chat_template`` digest: the tokenizer's own, a built-in one, or a template
    file); without a config beside it (a tokenizer converted from GPT-2, SentencePiece or tiktoken files) one
    is written naming the special tokens the manifest records. XprepError saying why when there is none.
    """
    datasets = _pack_datasets(Path(run), pack_key)
    manifests = [(d, read_json(d / MANIFEST, "dataset manifest", "re-create the dataset")) for d in datasets]
    digests = {str((m.get("tokenizer") or {}).get("sha256")) for _, m in manifests}
    if len(digests) != 1:
        raise XprepError(f"the datasets of {run}'s pack record {len(digests)} different tokenizers")
    sha = digests.pop()
    path = _find_tokenizer_json(manifests, sha)
    beside = path.parent / TOKENIZER_CONFIG
    config = read_json_or_empty(beside) if beside.is_file() else {}
    names = _added_tokens(path)
    manifest = manifests[0][1]
    ids = {"eos_token_id": (manifest.get("tokenizer") or {}).get("eod_id"),
           "pad_token_id": (manifest.get("tokenizer") or {}).get("pad_id"),
           "bos_token_id": ((manifest.get("special_tokens") or {}).get("bos") or {}).get("id")}
    ids = {k: v for k, v in ids.items() if isinstance(v, int)}
    if not config:
        config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  "eos_token": names.get(ids.get("eos_token_id")), "bos_token": names.get(ids.get("bos_token_id")),
                  "pad_token": names.get(ids.get("pad_token_id"))}
    template, which = _chat_template(config.get("chat_template"), [m for _, m in manifests])
    config = {k: v for k, v in config.items() if k != "chat_template"}
    if template is not None:
        config["chat_template"] = template
    copied = tuple(p for p in [path.parent / SPECIAL_TOKENS_MAP] if p.is_file() and beside.is_file())
    return DataTokenizer(path, sha, config, copied, ids, f"tokenizer: {path} (sha256 as the data's manifests "
                                                         f"record); chat template: {which}")


def _pack_datasets(run: Path, pack_key: str | None) -> list[Path]:
    """The dataset directories of the pack entry ``run`` trained on (run.json names it; ``pack_key``, when given,
    must be its key, else the entry with that key beside it is taken)."""
    pack = read_json_or_empty(run / "run.json").get("pack") or {}
    if not pack.get("path"):
        raise XprepError(f"{run}/run.json names no pack (it is written when training starts)")
    path, key = Path(pack["path"]), pack_key or pack.get("key")
    if not path.is_dir():
        where = "" if path.is_absolute() else f" (from {Path.cwd()}: run the export where the run was started)"
        raise XprepError(f"the pack {path} that {run}/run.json names is not found{where}")
    root = path.parent if (path / PACK_JSON).is_file() or (path / BLEND_JSON).is_file() else path
    for candidate in [path, *sorted(root.glob(f"*-{str(key)[:16]}"))]:
        entry = open_entry(candidate)
        if not key or entry.key == key:
            parts = getattr(entry, "sources", None) or [entry]
            return [p for part in parts for p in part.dataset_paths]
    raise XprepError(f"{root}: holds no pack entry {str(key)[:16]}, the one the checkpoint was trained on "
                     "(the cache was cleared or rebuilt)")


def _find_tokenizer_json(manifests: list[tuple[Path, dict]], sha: str) -> Path:
    """The first tokenizer.json a dataset records (or keeps) whose sha256 is ``sha``, preferring one with a
    tokenizer_config.json beside it; XprepError naming each recorded file and what is wrong with it."""
    found, problems = [], []
    for dataset, manifest in manifests:
        recorded = str((manifest.get("tokenizer") or {}).get("path") or "")
        kept = dataset / TOKENIZER_JSON
        for path in dict.fromkeys([dataset / recorded, kept] if recorded else [kept]):
            if path in found or (path == kept and not path.is_file() and path != dataset / recorded):
                continue  # no copy kept in the dataset: only the recorded file is worth a word
            if not path.is_file():
                problems.append(f"{path} is gone")
            elif file_sha256(path, "check the file") != sha:
                problems.append(f"{path} is not the one the data was tokenized with (its sha256 differs)")
            else:
                found.append(path)
    if not found:
        raise XprepError("the tokenizer the data was tokenized with is not found ("
                         + ("; ".join(dict.fromkeys(problems)) or "the datasets' manifests name none") + ")")
    return next((p for p in found if (p.parent / TOKENIZER_CONFIG).is_file()), found[0])


def _added_tokens(path: Path) -> dict[int, str]:
    """Id → text of a tokenizer.json's added (special) tokens."""
    added = read_json_or_empty(path).get("added_tokens") or []
    return {t["id"]: t["content"] for t in added if isinstance(t, dict) and "id" in t and "content" in t}


def _chat_template(own, manifests: list[dict]) -> tuple[str | list | None, str]:
    """The chat template for the export and, in words, which it is: the one the chat data was rendered with,
    found by its sha256 among the tokenizer's own, the built-in ones and a template file of that name; none
    when that one is not found or the data used several (and the tokenizer's own with text data only)."""
    used = {(t.get("name"), t.get("sha256")) for m in manifests if isinstance(t := m.get("chat_template"), dict)}
    if not used:
        return own, "the tokenizer's own (the data is text)" if own else "none (the data is text)"
    own_text = own if isinstance(own, str) else next(
        (t.get("template") for t in own or [] if isinstance(t, dict) and t.get("name") == "default"), None)
    if len(used) > 1:
        if own_text is not None and _sha(own_text) in {sha for _, sha in used}:
            return own, "the tokenizer's own (one of several the data was rendered with)"
        return None, f"none (the data was rendered with {len(used)} different templates)"
    name, sha = used.pop()
    if own_text is not None and _sha(own_text) == sha:
        return own, f"{name!r}, the one the data was rendered with"
    builtin = BUILTIN_TEMPLATES.get(str(name))
    if builtin is not None and _sha(builtin) == sha:
        return builtin, f"{name!r} (built in), the one the data was rendered with"
    file = Path(str(name))
    if file.is_file() and file_sha256(file, "check the file") == sha:
        return file.read_text(encoding="utf-8"), f"{name!r}, the one the data was rendered with"
    return None, (f"none: the one the data was rendered with ({name!r}, sha256 {str(sha)[:12]}…) is no longer "
                  f"where it was; set chat_template in {TOKENIZER_CONFIG} yourself")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def read_json_or_empty(path: Path) -> dict:
    """A JSON object's file read, or {} when it is missing or not JSON (optional metadata: config.json, run.json)."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
