"""Hugging Face weights in and out of the built-in model: `--model hf:DIR` and `xtrain export`."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from prepkit import tokenize, write_jsonl
from safetensors.torch import load_file, save_file
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from trainkit import category_pack, cp_pack
from xprep.cli import xprep, xtrain
from xprep.prep.chat.templates import BUILTIN_TEMPLATES
from xprep.prep.dataset.token_dataset import TokenDataset
from xprep.prep.errors import XprepError
from xprep.train.checkpoint import CheckpointManager
from xprep.train.config import ModelSection, OptimizerSection
from xprep.train.data import PackedDataset
from xprep.train.dist import ParallelDims, materialize
from xprep.train.hf import HFCausalLM
from xprep.train.hf_tokenizer import _chat_template
from xprep.train.hf_weights import hf_config_dict, name_map, param_shapes, read_hf_weights
from xprep.train.model import ModelConfig, Transformer

transformers = pytest.importorskip("transformers")

VOCAB = 300
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=512)
LENGTHS = [5, 17, 9]


def hf_model(kind: str, **overrides) -> torch.nn.Module:
    """A small random transformers model; norms and biases randomized too, so a mapping slip shows."""
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                             "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**SHAPE, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("weight") else 0.1 * torch.randn_like(p))
    return model.eval()


def save(model, path: Path, **kw) -> Path:
    model.save_pretrained(path, **kw)
    return path


def packed_input() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, sum(LENGTHS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return ids, pos, cu


def assert_same_as_transformers(model: Transformer, hf, tol: float = 1e-5) -> None:
    """The built-in model on the packed row == transformers on each document alone."""
    ids, pos, cu = packed_input()
    with torch.no_grad():
        ours = model.eval()(ids, pos, cu)[0]
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            theirs = hf(input_ids=ids[:, a:b], use_cache=False).logits[0].float()
            torch.testing.assert_close(ours[a:b], theirs, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {"rope_theta": 5e5}),
    ("llama", {"tie_word_embeddings": True}),
    ("qwen2", {"tie_word_embeddings": True}),  # q/k/v biases
    ("mistral", {"sliding_window": None}),
])
def test_hf_weights_load_into_the_builtin_model(kind, overrides, tmp_path):
    hf = hf_model(kind, **overrides)
    directory = save(hf, tmp_path / kind)
    model, config = ModelSection(f"hf:{directory}").build(128, seed=0)
    assert isinstance(model, Transformer), config
    assert config["hf"] == str(directory) and config.get("qkv_bias", False) is (kind == "qwen2")
    assert model.cfg.tie_embeddings is bool(overrides.get("tie_word_embeddings"))
    assert_same_as_transformers(model, hf)


def test_sharded_checkpoint(tmp_path):
    hf = hf_model("llama")
    directory = save(hf, tmp_path / "hf", max_shard_size="40KB")
    assert (directory / "model.safetensors.index.json").is_file()
    model, _ = ModelSection(f"hf:{directory}").build(128, seed=0)
    assert_same_as_transformers(model, hf)


@pytest.mark.parametrize("kind,overrides,why", [
    ("mistral", {"sliding_window": 16}, "sliding_window 16"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "RoPE scaling 'linear'"),
])
def test_other_architectures_fall_back_to_the_transformers_module(kind, overrides, why, tmp_path, capsys):
    directory = save(hf_model(kind, **overrides), tmp_path / "hf")
    section = ModelSection(f"hf:{directory}")
    assert section.check(128) is None  # → no context parallelism (trainer refuses --cp)
    model, _ = section.build(128, seed=0)
    assert isinstance(model, HFCausalLM)
    assert why in capsys.readouterr().err


def export(*args: str) -> CliRunner:
    return CliRunner().invoke(xtrain, ["export", *args])


@pytest.mark.parametrize("kind,overrides", [("llama", {}), ("qwen2", {"tie_word_embeddings": True})])
def test_export_round_trip(kind, overrides, tmp_path):
    packed = category_pack(tmp_path / "data")
    directory = save(hf_model(kind, **overrides), tmp_path / "hf")
    run = tmp_path / "run"
    trained = CliRunner().invoke(xtrain, ["run", str(packed), "--model", f"hf:{directory}", "--steps", "2",
                                          "--lr", "1e-2", "--output", str(run), "--log-every", "100"])
    assert trained.exit_code == 0, trained.output
    result = export(str(run), "--step", "2", "-o", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == kind
    assert (tmp_path / "out" / "generation_config.json").is_file()  # carried over from hf:DIR
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "out" / "model.safetensors").stat().st_mode) == 0o666 & ~umask  # not 0600

    # The run's model at step 2, restored by the trainer's own resume path.
    section = ModelSection(f"hf:{directory}")
    model, _ = section.build(128, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer, _ = OptimizerSection().build(model, 2)
    CheckpointManager(run, ParallelDims()).load(run / "checkpoints" / "step-2", model, optimizer,
                                                PackedDataset(packed).key)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # it did train

    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert_same_as_transformers(model, exported)


def test_export_errors_are_one_line(tmp_path):
    def error(*args: str) -> str:
        result = export(*args)
        assert result.exit_code == 2, (result.output, result.exception)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        return lines[0]

    assert "no checkpoint" in error(str(tmp_path / "nothing"), "-o", str(tmp_path / "o1"))
    packed = category_pack(tmp_path / "data")
    run = tmp_path / "run"
    assert CliRunner().invoke(xtrain, ["run", str(packed), "--steps", "1", "--output", str(run)]).exit_code == 0
    assert "has step 1" in error(str(run), "--step", "7", "-o", str(tmp_path / "o2"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert "not an empty directory" in error(str(run), "-o", str(tmp_path / "full"))
    assert export(str(run), "-o", str(tmp_path / "ok"), "--dtype", "bf16").exit_code == 0  # latest step, a preset
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ok")
    assert exported.config.model_type == "llama" and exported.dtype == torch.bfloat16


def test_context_parallel_run_from_hf_weights_and_its_export(tmp_path):
    """hf:DIR trains with CP=2 on 2 ranks (FSDP2) as on one process; the sharded checkpoint exports the same."""
    import os
    import subprocess
    import sys

    packed = cp_pack(tmp_path / "data")
    directory = save(hf_model("qwen2", tie_word_embeddings=True), tmp_path / "hf")
    common = [str(packed), "--model", f"hf:{directory}", "--steps", "2", "--micro-batch-size", "1",
              "--global-batch-size", "2", "--lr", "1e-2", "--log-every", "100"]
    one = CliRunner().invoke(xtrain, ["run", *common, "--output", str(tmp_path / "one")])
    assert one.exit_code == 0, one.output
    two = subprocess.run([str(Path(sys.executable).with_name("xtrain")), "run", *common, "--nproc-per-node", "2",
                          "--cp", "2", "--output", str(tmp_path / "two")], capture_output=True, text=True,
                         timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert two.returncode == 0, two.stderr[-3000:]
    losses = [[json.loads(x)["loss"] for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
              for r in ("one", "two")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5), losses
    for r in ("one", "two"):
        assert export(str(tmp_path / r), "-o", str(tmp_path / f"{r}-hf")).exit_code == 0
    a, b = (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{r}-hf").eval() for r in ("one", "two"))
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(a(input_ids=ids).logits, b(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------ the export's tokenizer
def trained_on_chat(root: Path, tokenizer: Path, chats: Path) -> tuple[Path, Path]:
    """(dataset, run): ``chats`` tokenized with ``tokenizer``, packed, trained one step with the built-in model."""
    tokenize(chats, root / "ds", tokenizer)
    packed = CliRunner().invoke(xprep, ["pack", str(root / "ds"), "-o", str(root / "packed"), "--method",
                                        "multipack", "--seq-len", "512", "--overlong", "split"])
    assert packed.exit_code == 0, packed.output
    run = root / "run"
    trained = CliRunner().invoke(xtrain, ["run", str(root / "packed"), "--model", "tiny", "--steps", "1",
                                          "--output", str(run), "--log-every", "100"])
    assert trained.exit_code == 0, trained.output
    return root / "ds", run


def test_export_carries_the_tokenizer_the_data_was_tokenized_with(shared_data, tmp_path):
    """Qwen3: the export's AutoTokenizer gives the tokenizer's ids and, with its chat template, rebuilds every
    training document; gone or changed, the tokenizer is a warning and a model-only export; a copy kept in the
    dataset is found (with a config built from the manifest)."""
    tokenizer_dir = tmp_path / "qwen3"
    shutil.copytree(shared_data / "tokenizers" / "qwen3", tokenizer_dir)
    with open(shared_data / "chat" / "chitchat.jsonl", encoding="utf-8") as f:
        head = [json.loads(next(f)) for _ in range(40)]
    chats = [r for r in head if any(m["role"] == "assistant" for m in r["messages"])][:12]
    dataset, run = trained_on_chat(tmp_path, tokenizer_dir, write_jsonl(tmp_path / "chat.jsonl", chats))
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
    text = "Hello world <|im_end|> naïve café — 日本語 😀\n  indented"

    result = export(str(run), "-o", str(tmp_path / "out"), "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    assert "tokenizer: " in result.stderr and "the one the data was rendered with" in result.stderr
    out = tmp_path / "out"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok(text)["input_ids"] == reference(text)["input_ids"]
    assert tok.chat_template == json.loads((tokenizer_dir / "tokenizer_config.json").read_text())["chat_template"]
    docs = TokenDataset(dataset)
    for i, record in enumerate(chats):  # the export's tokenizer and template rebuild what was trained on
        ids = tok.apply_chat_template(record["messages"], tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert list(ids) == docs.tokens[i].tolist(), i
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")

    shutil.move(tokenizer_dir, tmp_path / "moved")  # the tokenizer the manifest names is gone: model only
    result = export(str(run), "-o", str(tmp_path / "alone"), "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    warning = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and f"{tokenizer_dir / 'tokenizer.json'} is gone" in warning[0], result.stderr
    assert sorted(p.name for p in (tmp_path / "alone").iterdir()) == ["config.json", "model.safetensors"]

    kept = dataset / "tokenizer.json"  # a copy kept inside the dataset (as for converted tokenizers)
    shutil.copyfile(tmp_path / "moved" / "tokenizer.json", kept)
    result = export(str(run), "-o", str(tmp_path / "kept"), "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "kept" / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert "chat_template" not in config and "none: the one the data was rendered with" in result.stderr
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "kept")
    assert tok(text)["input_ids"] == reference(text)["input_ids"] and tok.eos_token == "<|im_end|>"

    kept.write_bytes(kept.read_bytes() + b"\n")  # not the tokenizer the data was made with: refused
    result = export(str(run), "-o", str(tmp_path / "changed"), "--dtype", "bf16")
    assert result.exit_code == 0 and "warning: " in result.stderr and "sha256 differs" in result.stderr
    assert not (tmp_path / "changed" / "tokenizer.json").exists()


def test_the_exported_chat_template_is_the_one_the_data_was_rendered_with(tmp_path):
    def used(name: str, text: str) -> dict:
        return {"chat_template": {"name": name, "sha256": hashlib.sha256(text.encode()).hexdigest()}}

    own, chatml = "{{ messages }}", BUILTIN_TEMPLATES["chatml"]
    assert _chat_template(own, [used("tokenizer", own)])[0] == own
    assert _chat_template(own, [used("chatml", chatml)])[0] == chatml  # --chat-template chatml: not the own one
    file = tmp_path / "t.jinja"
    file.write_text("{{ 'x' }}")
    assert _chat_template(own, [used(str(file), "{{ 'x' }}")])[0] == "{{ 'x' }}"
    missing, said = _chat_template(own, [used(str(tmp_path / "gone.jinja"), "{{ 'y' }}")])
    assert missing is None and "gone.jinja" in said  # never a template the model was not trained on
    assert _chat_template(own, [{"chat_template": None}]) == (own, "the tokenizer's own (the data is text)")
    assert _chat_template(own, [used("tokenizer", own), used("chatml", chatml)])[0] == own
    assert _chat_template(None, [used("a", "1"), used("b", "2")])[0] is None


# ------------------------------------------------------------------------------------------ reading lazily
SMALL = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96)
BIG = ModelConfig(vocab_size=4096, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512)  # untied: 2 big


def write_checkpoint(directory: Path, cfg: ModelConfig, dtype: torch.dtype, sharded: bool = False,
                     tweak=None) -> Path:
    """hf:DIR for ``cfg`` with random weights in ``dtype`` (the embeddings in a file of their own when
    ``sharded``); ``tweak(tensors)`` edits the Hugging Face state dict before it is written."""
    g = torch.Generator().manual_seed(0)
    to_hf = {b: h for h, b in name_map(cfg.n_layers).items()}
    tensors = {to_hf[name]: torch.randn(shape, generator=g).to(dtype) for name, shape in param_shapes(cfg).items()}
    if tweak is not None:
        tweak(tensors)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    if not sharded:
        save_file(tensors, directory / "model.safetensors")
        return directory
    files = {"model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if "embed" in k},
             "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if "embed" not in k}}
    for file, part in files.items():
        save_file(part, directory / file)
    weight_map = {k: file for file, part in files.items() for k in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


class AllocatedBytes(TorchDispatchMode):
    """The peak bytes of CPU tensor storages that torch's allocator made while this mode was on, sampled after
    every op. A file mapped by safetensors (``UntypedStorage.from_file``) is not resizable, an allocated
    storage is: mapped weights are page cache, not counted here (``resident_mapped_bytes`` counts them)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().resizable():
                ref = StorageWeakRef(t.untyped_storage())
                self.live.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def resident_mapped_bytes(files: list[Path]) -> int:
    """Bytes of ``files`` mapped into this process and resident (/proc/self/smaps), over all their mappings."""
    wanted, total, counting = {str(f.resolve()) for f in files}, 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line: address perms ... [path]
            counting = len(fields) >= 6 and " ".join(fields[5:]) in wanted
        elif counting and fields[:1] == ["Rss:"]:
            total += int(fields[1]) * 1024
    return total


def load(directory: Path, cfg: ModelConfig, eager: bool, probe=None) -> Transformer:
    """hf:DIR through ``ModelSection.build_meta`` and ``xprep.train.dist.materialize``, as ``xtrain run`` loads it;
    ``eager``: from the whole state dict read first (as hf:DIR was loaded before); ``probe(name)`` is called
    before every parameter is asked for."""
    model, _, initial = ModelSection(f"hf:{directory}").build_meta(cfg.vocab_size, seed=0)
    if eager:
        initial = dict(read_hf_weights(directory, cfg)).__getitem__

    def asked(name: str) -> torch.Tensor:
        if probe is not None:
            probe(name)
        return initial(name)

    materialize(model, torch.device("cpu"), asked)
    return model


def fp32_bytes(cfg: ModelConfig) -> dict[str, int]:
    return {name: 4 * math.prod(shape) for name, shape in param_shapes(cfg).items()}


def one_tensor(cfg: ModelConfig) -> int:
    """The fp32 bytes of the largest parameter: what materialize may hold besides the model (the whole tensor
    it is cutting this rank's shard from; it lets it go before asking for the next)."""
    return max(fp32_bytes(cfg).values())


def test_hf_weights_are_read_one_tensor_at_a_time(tmp_path):
    """A bf16 checkpoint (as Hugging Face ships them) loads holding one whole fp32 tensor besides the model,
    never the whole state dict in fp32 as it did: on N ranks
    that was N × 4 bytes × parameters of host memory."""
    directory = write_checkpoint(tmp_path / "hf", BIG, torch.bfloat16)
    model_bytes = sum(fp32_bytes(BIG).values())
    bound = one_tensor(BIG)
    assert bound < model_bytes / 2  # the test tells the two apart

    with AllocatedBytes() as lazy:
        model = load(directory, BIG, eager=False)
    assert lazy.peak - model_bytes <= bound, (lazy.peak - model_bytes, bound)
    with AllocatedBytes() as eager:  # the same measure sees the whole-read loader
        load(directory, BIG, eager=True)
    assert eager.peak - model_bytes >= model_bytes

    reference = load_file(directory / "model.safetensors")  # and the values are the file's
    for hf_name, name in name_map(BIG.n_layers).items():
        if hf_name in reference:
            assert torch.equal(model.get_parameter(name), reference[hf_name].float()), name


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="needs Linux's /proc/self/smaps")
def test_mapped_weights_are_unmapped_tensor_by_tensor(tmp_path):
    """An fp32 checkpoint is read through its mmap without a copy; each tensor's pages are let go once
    materialize is done with it, so the file is never resident whole (it was, all of it, by the end), and
    nothing of it stays mapped after loading. Sharded: the index's files."""
    directory = write_checkpoint(tmp_path / "hf", BIG, torch.float32, sharded=True)
    files = sorted(directory.glob("*.safetensors"))
    page_slack = 1 << 20  # whole pages, and the kernel's fault-around at each end of a mapped tensor

    seen = []
    model = load(directory, BIG, eager=False, probe=lambda name: seen.append(resident_mapped_bytes(files)))
    assert max(seen) <= one_tensor(BIG) + page_slack, (max(seen), one_tensor(BIG))
    del model
    assert resident_mapped_bytes(files) == 0

    seen.clear()  # the same measure sees the whole-read loader keep all of it
    load(directory, BIG, eager=True, probe=lambda name: seen.append(resident_mapped_bytes(files)))
    assert max(seen) >= sum(fp32_bytes(BIG).values()) - max(fp32_bytes(BIG).values())


def test_hf_weights_errors_are_found_in_the_headers(tmp_path):
    """What is wrong with a checkpoint is said before anything is loaded, from the headers alone (names,
    shapes, dtypes, unreadable files); a file changed after that is said when its tensor is read."""
    def error(name: str, **kw) -> str:
        directory = write_checkpoint(tmp_path / name, SMALL, torch.bfloat16, **kw)
        with pytest.raises(XprepError) as e:
            read_hf_weights(directory, SMALL)
        assert str(e.value).startswith(f"--model hf:{directory}: ")
        return str(e.value)

    assert "missing ['output.weight']" in error("missing", tweak=lambda t: t.pop("lm_head.weight"))
    assert "unexpected ['model.layers.9.mlp.up_proj.weight']" in error(
        "extra", tweak=lambda t: t.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(2)}))
    said = error("shape", tweak=lambda t: t.update({"model.norm.weight": torch.ones(SMALL.dim + 1)}))
    assert f"model.norm.weight in model.safetensors has shape [{SMALL.dim + 1}]" in said
    assert f"needs [{SMALL.dim}]" in said
    said = error("int", tweak=lambda t: t.update({"model.norm.weight": torch.ones(SMALL.dim, dtype=torch.int8)}))
    assert "model.norm.weight in model.safetensors is I8, not floating point" in said

    directory = write_checkpoint(tmp_path / "sharded", SMALL, torch.bfloat16, sharded=True)
    shard = directory / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    with pytest.raises(XprepError, match=f"cannot read {shard} .*re-download"):
        read_hf_weights(directory, SMALL)
    (directory / "model.safetensors.index.json").write_text("{")
    with pytest.raises(XprepError, match="cannot read model.safetensors.index.json"):
        read_hf_weights(directory, SMALL)

    directory = write_checkpoint(tmp_path / "later", SMALL, torch.bfloat16)
    weights = read_hf_weights(directory, SMALL)
    assert torch.equal(weights["norm.weight"], load_file(directory / "model.safetensors")["model.norm.weight"].float())
    (directory / "model.safetensors").unlink()
    with pytest.raises(XprepError, match="cannot read model.norm.weight from .*model.safetensors"):
        weights["norm.weight"]
