"""A run's Ray side (``rayhf.runtime.session``) before any Ray starts: the spec of every rank it
would start, where each role's first weights come from, and the placement the driver reads."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

import rayhf
from rayhf.engines.config import NativeEngineConfig
from rayhf.graph import load_graph
from rayhf.parallel.layout import Layout
from rayhf.planner.plan import Plan
from rayhf.runtime.assets import RunAssets
from rayhf.runtime.session import Session, _interrupts_deferred

REPO = Path(__file__).resolve().parents[3]
GRAPH = load_graph(REPO / "graphs" / "ppo.yaml")
HOME, GEN = Layout((0, 1), 2), Layout((0, 1), 1, 2)  # the actor trains dp=2, generates tp=2
ONE, TWO = Layout((0,), 1), Layout((1,), 1)
LAYOUTS = {"actor_gen": GEN, "rew_inf": ONE, "ref_inf": ONE, "critic_inf": TWO,
           "actor_train": HOME, "critic_train": TWO}  # fmt: skip


class _Session(Session):
    def _model_files(self, path: str, value_head: bool, role: str):  # no model on disk here
        return SimpleNamespace(path=path, value_head=value_head)  # where the shape was read


def _session(tmp_path: Path, resume: Path | None = None, *overrides: str) -> Session:
    cfg = rayhf.load_config(REPO / "examples" / "ppo_tiny.yaml", list(overrides))
    init = tmp_path / "init"
    assets = RunAssets(
        run_dir=tmp_path, graph=GRAPH, plan=Plan(LAYOUTS, "manual"), dataset=None,
        eval_dataset=None, tokenizer_dir=tmp_path / "tokenizer",
        model_dirs={"actor": init / "actor", "ref": init / "actor", "critic": init / "critic"},
        specs={}, special_ids={"pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1},
        trainable={"actor", "critic"},
    )  # type: ignore[arg-type]  # fmt: skip
    return _Session(cfg, assets, resume)


def test_each_rank_s_spec_follows_the_plan(tmp_path: Path):
    session = _session(tmp_path)
    home = session._spec("actor", HOME, 1, threads=3)
    assert [c.name for c in home.calls] == ["actor_train"]
    shape = (home.role, home.rank, home.dp_size, home.tp_size, home.pp_size, home.n_microbatches)
    assert shape == ("actor", 1, 2, 1, 1, 1)
    assert (home.layout_name, home.threads, home.device) == ("d0-1.dp2tp1pp1", 3, "cpu")
    optimizer = session.cfg.models["actor"].optimizer
    assert home.optimizer is not None, "trained at home"
    # the same settings, its schedule's decay ending at the run's last step
    assert home.optimizer.schedule.total_steps == session.cfg.steps
    assert home.optimizer.model_copy(update={"schedule": optimizer.schedule}) == optimizer
    assert home.tokenizer_dir == str((tmp_path / "tokenizer").resolve())
    copy = session._spec("actor", GEN, 0, threads=1)
    assert [c.name for c in copy.calls] == ["actor_gen"] and copy.optimizer is None
    (gen,) = copy.calls
    assert (gen.kind, gen.interface) == ("generate", "ppo_actor")
    assert gen.engine == NativeEngineConfig() and gen.inputs == {"prompts": "prompts"}
    assert set(gen.outputs) == {"seq", "prompt_lens", "logprobs"}
    (ref,) = session._spec("ref", ONE, 0, threads=1).calls
    assert ref.outputs == {"logprobs": "ref_logprobs"}  # the graph's output_remap
    critic = session._spec("critic", TWO, 0, threads=1)
    assert [c.name for c in critic.calls] == ["critic_inf", "critic_train"] and critic.value_head
    assert not home.activation_checkpointing
    ckpt = _session(tmp_path, None, "models.actor.activation_checkpointing=true")
    assert ckpt._spec("actor", HOME, 1, threads=3).activation_checkpointing
    assert not ckpt._spec("critic", TWO, 0, threads=1).activation_checkpointing


def test_where_each_role_s_first_weights_come_from(tmp_path: Path):
    init = tmp_path / "init"
    fresh = _session(tmp_path)
    actor = fresh._spec("actor", HOME, 0, threads=1)
    where = str((init / "actor").resolve())
    assert (actor.model_dir, actor.model.path) == (where, where)
    assert actor.special_ids == {"pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1}
    ref = fresh._spec("ref", ONE, 0, threads=1)
    assert (ref.model_dir, ref.model.path) == (None, where), (
        "init_from: the source's shape, the weights arrive by reallocation"
    )
    critic = fresh._spec("critic", TWO, 0, threads=1)
    assert critic.model.value_head and not ref.model.value_head
    reward = fresh._spec("reward", ONE, 0, threads=1)
    assert (reward.model_dir, reward.model) == (None, None)
    assert reward.settings.function == "rayhf.tasks.demo:reward"
    assert actor.version == 0, "fresh weights come from no update"
    ckpt = tmp_path / "checkpoints" / "step_000004"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text('{"step": 4}')
    resumed = _session(tmp_path, ckpt)
    actor = resumed._spec("actor", HOME, 0, threads=1)
    assert actor.model_dir == str((ckpt / "actor").resolve())
    assert actor.version == 4, "a resume's weights come from the checkpoint step's update"
    assert resumed._spec("critic", TWO, 0, threads=1).model_dir == str((ckpt / "critic").resolve())
    assert actor.model.path == actor.model_dir, "the shape read from the checkpoint"
    ref = resumed._spec("ref", ONE, 0, threads=1)
    assert (ref.model_dir, ref.model.path) == (where, where)


def test_only_a_zero3_train_layout_holds_flat_slices(tmp_path: Path):
    zero3 = ("engines.critic_train.engine=deepspeed", "engines.critic_train.zero_stage=3")
    session = _session(tmp_path, None, *zero3)
    assert session._zero3("critic", TWO)
    assert not session._zero3("actor", HOME) and not session._zero3("critic", ONE)
    assert not _session(tmp_path)._zero3("critic", TWO)


def test_the_placement_names_groups_homes_and_moving_average_followers(tmp_path: Path):
    session = _session(tmp_path, None, "models.ref.ema=0.1")
    group = lambda role, lay: SimpleNamespace(key=f"{role}.{lay.name}", layout=lay)  # noqa: E731
    homes = {"actor": HOME, "reward": ONE, "ref": ONE, "critic": TWO}
    session.groups = {r: group(r, lay) for r, lay in homes.items()}  # type: ignore[misc]
    session.copies = {"actor.d0-1.dp1tp2pp1": group("actor", GEN)}  # type: ignore[dict-item]
    placement = session.placement()
    keys = {f"{r}.{lay.name}" for r, lay in homes.items()} | {"actor.d0-1.dp1tp2pp1"}
    assert set(placement.groups) == keys and len(keys) == 5
    assert placement.layouts == LAYOUTS and placement.homes == homes
    assert (
        placement.step.followers == {"actor": [("ref", 0.1)]} and placement.mover is session.mover
    )
    assert _session(tmp_path).placement().step.followers == {}


def test_ctrl_c_during_teardown_waits_for_it_then_interrupts():
    before = signal.getsignal(signal.SIGINT)
    done = []
    with pytest.raises(KeyboardInterrupt), _interrupts_deferred():
        os.kill(os.getpid(), signal.SIGINT)  # handled at once, in this (the main) thread
        done.append("the rest of the teardown")
    assert done and signal.getsignal(signal.SIGINT) is before
    with _interrupts_deferred():  # no Ctrl-C: nothing raised
        pass
    # a teardown that failed meanwhile
    with pytest.raises(KeyboardInterrupt) as raised, _interrupts_deferred():
        os.kill(os.getpid(), signal.SIGINT)
        raise RuntimeError("an actor would not die")
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert signal.getsignal(signal.SIGINT) is before
