"""`--cp-mode` and `--ulysses` from the command line to the layout (issue 33, the plumbing): the options and their
config fields, the impossible combinations as one line before any process starts, ParallelDims' process groups of
each mode and their rank layout, what the trainer hands the attention, the start line, run.json, the run report,
and a resume under another mode.

The process groups are made under torch's in-process fake backend, one rank at a time: it makes the groups
a real world of that size would (their members are what is checked), without processes.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch.distributed as dist
from click.testing import CliRunner
from torch.testing._internal.distributed.fake_pg import FakeStore
from trainkit import category_pack, cp_pack, make_trainer, user_error
from xprep import cli
from xprep.prep.errors import XprepError
from xprep.prep.inspect.html import write_page
from xprep.prep.inspect.text import render_run
from xprep.train import trainer as trainer_module
from xprep.train.config import ParallelSection, TrainConfig, resolve_config
from xprep.train.cp import CP_MODES
from xprep.train.dist import ParallelDims
from xprep.train.report import run_report
from xprep.train.samplers import BatchPlan
from xprep.train.trainer import _start_line, _write_run_config, prepare_run


@contextlib.contextmanager
def fake_world(rank: int, world: int):
    """This process as rank ``rank`` of ``world`` (torch's fake backend: groups are made, collectives do nothing)."""
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def ranks(group) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


@pytest.fixture(scope="module")
def cp8(tmp_path_factory):
    """A pack with room for --cp 8 (and so for 4 and 2)."""
    return cp_pack(tmp_path_factory.mktemp("cp8"), cp_size=8)


# ------------------------------------------------------------------------------------------------ options
def test_the_options_are_config_fields_and_one_list_of_modes(repo_root):
    cfg = resolve_config(None, {"packed": "p", "cp": 4, "cp_mode": "hybrid", "ulysses": 2})
    assert (cfg.parallel.cp_mode, cfg.parallel.ulysses) == ("hybrid", 2)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg  # config.json reads back
    default = TrainConfig.from_dict({"packed": "p"}).parallel
    assert (default.cp_mode, default.ulysses) == ("ring", None)
    schema = json.loads((repo_root / "schemas" / "train.schema.json").read_text())["properties"]["parallel"]
    choices = next(p for p in cli.xtrain.commands["run"].params if p.name == "cp_mode").type.choices
    assert tuple(choices) == tuple(schema["properties"]["cp_mode"]["enum"]) == CP_MODES == cli.CP_MODES
    assert "[default: ring]" in " ".join(CliRunner().invoke(cli.xtrain, ["run", "--help"]).output.split())


@pytest.mark.parametrize("args,message", [
    (["--cp", "2", "--cp-mode", "hybrid"], "--cp-mode hybrid needs --ulysses N (the head-parallel factor; --cp 2 = "
                                           "N × ring size): N in [1, 2]"),
    (["--cp", "4", "--cp-mode", "hybrid", "--ulysses", "3"], "--ulysses 3 does not divide --cp 4: choose N in "
                                                             "[1, 2, 4]"),
    (["--cp", "2", "--cp-mode", "ring", "--ulysses", "2"], "--ulysses 2 is the head-parallel factor of --cp-mode "
                                                           "hybrid, not of ring"),
    (["--cp", "2", "--cp-mode", "hybrid", "--ulysses", "0"], "--ulysses 0 must be ≥ 1"),
])
def test_impossible_combinations_are_one_line_before_any_process(tmp_path, args, message):
    line = user_error("p", "--nproc-per-node", "2", *args, "--output", str(tmp_path / "run"))
    assert message in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args,message", [
    (["--cp-mode", "ulysses"], "--cp-mode ulysses splits the 4 attention heads over --cp 8 ranks, which does not "
                               "divide them: use --cp in [2, 4]"),
    (["--cp-mode", "hybrid", "--ulysses", "8"], "--cp-mode hybrid splits the 4 attention heads over --ulysses 8 "
                                                "ranks, which does not divide them: use --ulysses in [1, 2, 4]"),
])
def test_a_head_split_the_model_cannot_make_is_refused_before_launching(cp8, tmp_path, args, message):
    """The tiny model has 4 heads: 8 Ulysses ranks cannot split them. The launcher checks the run before it
    starts the 8 ranks, and says so in one line."""
    line = user_error(str(cp8), "--nproc-per-node", "8", "--cp", "8", *args, "--output", str(tmp_path / "run"))
    assert message in line, line


def test_head_splits_the_model_can_make_pass_the_set_up(cp8, tmp_path):
    for options, world in (({"cp": 4, "cp_mode": "ulysses"}, 4), ({"cp": 8, "cp_mode": "hybrid", "ulysses": 4}, 8),
                           ({"cp": 8}, 8)):
        cfg = resolve_config(None, {"packed": str(cp8), "output": str(tmp_path / "run"), **options})
        assert prepare_run(cfg, cfg.parallel.build(world=world)).resume_from is None


# ------------------------------------------------------------------------------------------------ layout
def test_parallel_dims_carry_the_mode_and_its_factor():
    dims = ParallelSection(cp=4, cp_mode="hybrid", ulysses=2).build(world=8)
    assert (dims.dp, dims.cp, dims.cp_mode, dims.ulysses, dims.ulysses_degree) == (2, 4, "hybrid", 2, 2)
    assert ParallelDims.for_world(4, cp=4, cp_mode="ulysses").ulysses_degree == 4
    assert ParallelDims.for_world(4, cp=4).ulysses_degree == 1 and ParallelDims().cp_mode == "ring"
    assert ParallelDims.for_world(4, cp=2, cp_mode="allgather").ulysses_degree == 1
    with pytest.raises(XprepError, match="needs --ulysses N"):
        ParallelDims.for_world(4, cp=4, cp_mode="hybrid")


def test_hybrid_groups_are_ring_index_by_ulysses_index_inside_each_dp_rank():
    """dp 2 × cp 4, U = 2: rank = dp_rank·4 + ring_index·2 + ulysses_index."""
    for rank in range(8):
        with fake_world(rank, 8):
            dims = ParallelDims.for_world(8, cp=4, cp_mode="hybrid", ulysses=2, rank=rank)
            groups = dims.cp_groups()
            base, ring, uly = 4 * (rank // 4), (rank % 4) // 2, rank % 2
            assert ranks(groups.cp) == [base + i for i in range(4)]
            assert ranks(groups.ring) == [base + uly, base + 2 + uly]
            assert ranks(groups.ulysses) == [base + 2 * ring, base + 2 * ring + 1]
            assert dims.cp_rank == 2 * ring + uly


@pytest.mark.parametrize("mode,ring,uly", [("ring", True, False), ("ulysses", False, True),
                                           ("allgather", False, False)])
def test_a_mode_gets_only_the_groups_it_talks_over_and_no_mesh_beyond_cp(mode, ring, uly):
    with fake_world(5, 8):
        dims = ParallelDims.for_world(8, cp=4, cp_mode=mode, rank=5)
        groups = dims.cp_groups()
        cp = ranks(groups.cp)
        assert cp == [4, 5, 6, 7] and ranks(groups.ring) == (cp if ring else None)
        assert ranks(groups.ulysses) == (cp if uly else None)
        assert sorted(dims._meshes) == ["dp,cp"]  # the whole CP group serves: no (dp, ring, ulysses) mesh made


def test_the_trainer_hands_the_mode_and_its_groups_to_the_attention(tmp_path, monkeypatch):
    trainer = make_trainer(category_pack(tmp_path), micro=1, accum=1)
    calls = []
    monkeypatch.setattr(trainer_module, "cp_context", lambda *args: calls.append(args) or len(calls))
    with fake_world(1, 4):
        trainer.dims = ParallelDims.for_world(4, cp=4, cp_mode="hybrid", ulysses=2, rank=1)
        assert (trainer.cp_context({}), trainer.cp_context({})) == (1, 2)
        (_, mode, rank, size, ulysses, groups), again = calls
        assert (ranks(groups.ring), ranks(groups.ulysses)) == ([1, 3], [0, 1])
    assert (mode, rank, size, ulysses) == ("hybrid", 1, 4, 2) and again[5] is groups  # groups made once
    trainer.dims = ParallelDims()
    assert trainer.cp_context({}) is None and len(calls) == 2


# ------------------------------------------------------------------------------------------------ what a run says
def test_start_line_run_json_and_report_say_the_mode(tmp_path):
    """A one-process run, then its layout said as a dp 1 × cp 4 hybrid run would say it (the ranks stubbed), in
    the start line, run.json and the report, text and HTML."""
    packed = cp_pack(tmp_path / "data", cp_size=4)
    result = CliRunner().invoke(cli.xtrain, ["run", str(packed), "--steps", "1", "--output", str(tmp_path / "run"),
                                             "--log-every", "100"])
    assert result.exit_code == 0, result.output
    assert "(micro-batch 1 × 1 DP × 1 accumulation; 1 DP, cpu, fp32" in result.stderr  # no mode without CP
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert (info["cp"], info["cp_mode"], info["ulysses"]) == (1, "ring", 1)
    report = run_report(tmp_path / "run")
    assert report["layout"] == "1 DP, fp32" and "  layout" in render_run(report)

    cfg = TrainConfig.from_dict({"packed": str(packed), "cp": 4, "cp_mode": "hybrid", "ulysses": 2})
    trainer = make_trainer(packed, micro=1, accum=1)
    trainer.dims = ParallelDims.for_world(4, cp=4, cp_mode="hybrid", ulysses=2, fsdp=True)
    line = _start_line(cfg, trainer, BatchPlan(1, 1, 1, 1, 1), "SDPA per piece")
    assert "; 1 DP × 4 CP (hybrid: 2 Ulysses × 2 ring), FSDP2, cpu, fp32, attention: SDPA per piece)" in line
    _write_run_config(tmp_path / "run", cfg, BatchPlan(1, 1, 1, 1, 1), {}, trainer.dataset, trainer.dims)
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert (info["cp"], info["cp_mode"], info["ulysses"]) == (4, "hybrid", 2)
    report = run_report(tmp_path / "run")
    shown = [x for x in render_run(report).splitlines() if x.strip().startswith("layout")]
    assert shown == ["  layout        1 DP × 4 CP (hybrid: 2 Ulysses × 2 ring), FSDP2, fp32"], shown
    write_page([report], tmp_path / "page.html")
    page = (tmp_path / "page.html").read_text()
    assert "<li>layout 1 DP × 4 CP (hybrid: 2 Ulysses × 2 ring), FSDP2, fp32</li>" in page
    for mode, factor, said in (("ring", 1, "4 CP (ring)"), ("ulysses", 4, "4 CP (ulysses)")):
        trainer.dims = ParallelDims.for_world(4, cp=4, cp_mode=mode)
        assert f"1 DP × {said}, FSDP2, cpu" in _start_line(cfg, trainer, BatchPlan(1, 1, 1, 1, 1))
        assert trainer.dims.ulysses_degree == factor
    (tmp_path / "run" / "run.json").write_text(json.dumps({"dp": 1, "cp": 2, "fsdp": True}))  # before --cp-mode
    assert run_report(tmp_path / "run")["layout"] == "1 DP × 2 CP (allgather), FSDP2"


def test_a_run_resumes_under_another_cp_mode(tmp_path):
    """A checkpoint holds no layout: resuming with another --cp, --cp-mode or --ulysses is not refused, and the
    console says what changed from the run's config. Leaving hybrid drops the run's --ulysses with it."""
    packed = cp_pack(tmp_path / "data", cp_size=2)
    run = tmp_path / "run"
    result = CliRunner().invoke(cli.xtrain, ["run", str(packed), "--steps", "2", "--output", str(run),
                                             "--log-every", "100"])
    assert result.exit_code == 0, result.output
    notes: list[str] = []
    cfg = resolve_config(None, {"output": str(run), "steps": 4, "nproc_per_node": 2, "cp": 2, "cp_mode": "hybrid",
                                "ulysses": 2}, log=notes.append)
    setup = prepare_run(cfg, cfg.parallel.build(world=2))
    assert setup.resume_from == run / "checkpoints" / "step-2"
    assert "--cp 1 → 2" in notes[0] and "--cp-mode ring → hybrid" in notes[0] and "--ulysses unset → 2" in notes[0]
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))  # as the hybrid run would have left it
    notes.clear()
    cfg = resolve_config(None, {"output": str(run), "cp_mode": "ring"}, log=notes.append)  # no --ulysses to drop
    assert (cfg.parallel.cp, cfg.parallel.cp_mode, cfg.parallel.ulysses) == (2, "ring", None)
    assert "--cp-mode hybrid → ring" in notes[0] and "--ulysses 2 → unset" in notes[0]
    assert prepare_run(cfg, cfg.parallel.build(world=2)).resume_from == run / "checkpoints" / "step-2"
