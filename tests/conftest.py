"""Shared test fixtures: paths, the real-data skip marker, a tiny offline tokenizer, a CLI runner.

Kept generic on purpose: fixtures for one area live in that area's test files.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The suite is the CPU reference: every run it starts (in process, through the CLI, or as torchrun ranks, which
# inherit the environment) computes on the CPU with gloo, on a GPU machine too. Tests of the device choice itself
# set or clear it themselves.
os.environ["XTRAIN_DEVICE"] = "cpu"

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = REPO_ROOT.parent / "shared" / "data"

requires_shared_data = pytest.mark.skipif(
    not SHARED.is_dir(),
    reason=f"real test data not found at {SHARED} (../shared/data from the project root, see its README.md); "
    "tests on real corpora and tokenizers are skipped",
)

# A ChatML template with a generation prompt: enough for chat tests on the tiny tokenizer.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Meta's Llama 3.1 and 3.2 Instruct chat templates, byte for byte as their tokenizer_config.json holds them (the
# sha256 of each is one the registry's llama3.1 entry recognises): what the fast path must agree with
META_TEMPLATES = {name: (REPO_ROOT / "tests" / "templates" / f"{name}-instruct.jinja").read_text(encoding="utf-8")
                  for name in ("llama-3.1", "llama-3.2")}


def held_template_sources() -> list[str]:
    """The texts of templates the registry recognises by sha256 only (their authors' texts, which xprep does not
    ship) that the tests hold: every tests/templates/*.jinja and, with the shared data, Qwen3's own."""
    texts = [p.read_text(encoding="utf-8") for p in sorted((REPO_ROOT / "tests" / "templates").glob("*.jinja"))]
    qwen3 = SHARED / "tokenizers" / "qwen3" / "tokenizer_config.json"
    if qwen3.is_file():
        texts.append(json.loads(qwen3.read_text(encoding="utf-8"))["chat_template"])
    return texts


def known_templates(every_source: bool = False) -> dict:
    """The tests' table of templates, read from the chat registry: a TemplateSpec per registered template, by its
    name, of its first source the tests hold (``every_source``: one per source, the second and later named
    NAME#2, ...), with the entry's own BOS and EOS tokens. A template whose only sources are held in the shared
    data is left out without it."""
    from xprep.prep.chat import TEMPLATES, TemplateSpec  # (on use: conftest loads for every test, chat or not)
    from xprep.prep.chat.registry import sha256

    held = {sha256(text): text for text in held_template_sources()}
    table = {}
    for entry in TEMPLATES:
        texts = [*entry.sources, *(held[sha] for sha in entry.sha256s if sha in held)]
        for k, text in enumerate(texts if every_source else texts[:1]):
            table[entry.name if k == 0 else f"{entry.name}#{k + 1}"] = TemplateSpec(entry.name, text, entry.bos,
                                                                                   entry.eos)
    return table


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data``; skips the test (with the reason) when it is absent."""
    if not SHARED.is_dir():
        pytest.skip(f"real test data not found at {SHARED} (../shared/data from the project root)")
    return SHARED


def _training_corpus() -> list[str]:
    """Deterministic text present on every machine: a few standard-library sources plus prose."""
    import json as json_module
    import textwrap

    texts = []
    for module in (textwrap, json_module):
        path = Path(module.__file__)
        files = sorted(path.parent.glob("*.py")) if path.name == "__init__.py" else [path]
        texts += [f.read_text(encoding="utf-8") for f in files]
    texts.append(
        "The quick brown fox jumps over the lazy dog. Hello world! How are you today? "
        "I am fine, thanks. Numbers 0123456789 and punctuation: ; , . ! ? ' \" ( ) [ ] { }\n" * 20
    )
    return texts


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer (vocab 600) trained offline; a directory with tokenizer.json and
    tokenizer_config.json (eos ``<|endoftext|>``, a ChatML chat template). Ids fit uint16."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=TINY_SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    tok.save(str(out / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "bos_token": None,
              "chat_template": TINY_CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def xprep_cli(*args, timeout: float = 300, cwd: str | Path | None = None) -> tuple[int, str, str]:
    """Run ``xprep ARGS...`` in a fresh process (not a TTY: no progress bar); (exit code, stdout, stderr)."""
    script = Path(sys.executable).with_name("xprep")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-c", "from xprep import cli; cli.xprep()"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=env)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size="256k", name="disk")``: a tmpfs of ``size`` at ``tmp_path / name``, a disk that fills up
    (tests/diskkit.py: run commands on it with its ``run``); skips the test where none can be mounted."""
    from diskkit import small_disk as mount

    with contextlib.ExitStack() as stack:
        yield lambda size="256k", name="disk": stack.enter_context(mount(tmp_path / name, size))


@pytest.fixture(scope="session")
def run_cli():
    """``run_cli("tokenize", ...)`` → (exit code, stdout, stderr) of ``xprep`` in a subprocess."""
    return xprep_cli
