"""One role-group rank (``rayhf.runtime.worker.RoleWorker``) in this process: a world of one rank
joins no process group, so the DAG node methods run without Ray. A PPO step flows through the
nodes, weights move in and out, and checkpoints land where ``optim_file`` says."""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rayhf.algorithms import InterfaceSettings
from rayhf.algorithms.ppo import PPOConfig
from rayhf.data.batch import PackedBatch
from rayhf.engines.config import default_engine
from rayhf.engines.torch_trainer import OptimizerConfig
from rayhf.graph import load_graph
from rayhf.models.files import special_ids
from rayhf.models.hf import (
    ModelInit,
    build_model,
    hf_config,
    model_files,
    read_model_config,
    save_model,
)
from rayhf.parallel.layout import Layout
from rayhf.realloc.plan import plan_realloc
from rayhf.runtime.messages import CallNode, CallSpec, MoveNode, StepInput, WorkerSpec
from rayhf.runtime.worker import RoleWorker, optim_file
from rayhf.sampling import GenerationConfig
from rayhf.tasks.demo import build_tokenizer

PPO = load_graph(Path(__file__).resolve().parents[3] / "graphs" / "ppo.yaml")
ROLES = {  # role -> (value head, optimizer, reward function)
    "actor": (False, OptimizerConfig(lr=1e-2), None),
    "ref": (False, None, None),
    "critic": (True, OptimizerConfig(), None),
    "reward": (False, None, "rayhf.tasks.demo:reward"),
}
TOK = build_tokenizer()  # the ids of the one saved under each test's tmp/tokenizer


def _spec(role: str, tmp: Path) -> WorkerSpec:
    value_head, optimizer, function = ROLES[role]
    where = tmp / ("critic" if value_head else "lm")
    files = model_files(read_model_config(where, value_head, role), value_head)
    calls = tuple(
        CallSpec(c.name, c.kind, c.interface, dict(c.args), c.interface_inputs(),
                 c.interface_outputs(), default_engine(c.kind))
        for c in PPO.calls
        if c.role == role
    )  # fmt: skip
    return WorkerSpec(
        role=role, layout_name="d0.dp1tp1pp1", rank=0, dp_size=1, tp_size=1, pp_size=1,
        n_microbatches=1, calls=calls,
        settings=InterfaceSettings(PPOConfig(), GenerationConfig(max_new_tokens=3), function),
        tokenizer_dir=str(tmp / "tokenizer"), special_ids=special_ids(TOK),
        model=None if function else files,
        model_dir=None if function else str(where), value_head=value_head,
        optimizer=optimizer, seed=1, threads=1,
    )  # fmt: skip


@pytest.fixture
def workers(tmp_path: Path, monkeypatch) -> dict[str, RoleWorker]:
    # a worker sets OMP_NUM_THREADS for its process; here that is the test process: restore it
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    tok = build_tokenizer(tmp_path / "tokenizer")
    init = ModelInit(hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2)
    config = hf_config(init, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    for name, value_head in (("lm", False), ("critic", True)):
        save_model(build_model(config, value_head, seed=1), tmp_path / name)
    out = {role: RoleWorker(_spec(role, tmp_path)) for role in ROLES}
    for worker in out.values():
        worker.setup("tcp://127.0.0.1:1")  # one rank: no process group to join
    return out


@pytest.fixture
def step(workers) -> StepInput:
    tok = workers["actor"].tokenizer
    ids = [[tok.bos_token_id, *tok.encode(p, add_special_tokens=False)] for p in ("1 2 =", "3 =")]
    flat = torch.tensor([t for row in ids for t in row])
    return StepInput(1, PackedBatch([0, 1], {"prompts": flat}, {"prompts": [len(r) for r in ids]}))


def _digest(worker: RoleWorker) -> float:
    return worker.weights_summary().digest


def test_a_ppo_step_flows_through_the_nodes_under_graph_key_names(workers, step):
    gen = workers["actor"].dag_call(step, CallNode("actor_gen", ()))
    assert (gen.call, gen.rank, gen.engine, gen.stats) == ("actor_gen", 0, "native", {})
    assert gen.batch is not None and gen.batch.sample_ids == [0, 1]
    assert gen.batch.keys() == ["seq", "prompt_lens", "logprobs"]
    new = gen.batch.seqlens["logprobs"]
    assert len(new) == 2 and all(1 <= n <= 3 for n in new)
    assert gen.batch.seqlens["seq"] == [n + p for n, p in zip(new, [6, 4], strict=True)]
    assert gen.began <= gen.ended
    scores = workers["reward"].dag_call(step, CallNode("rew_inf", ("actor_gen",)), gen)
    assert scores.batch is not None and scores.batch.keys() == ["scores"]
    # a result that is not a source only orders the node
    ref = workers["ref"].dag_call(step, CallNode("ref_inf", ("actor_gen",)), gen, scores)
    assert ref.batch is not None and ref.batch.keys() == ["ref_logprobs"]  # output_remap
    assert ref.batch.seqlens["ref_logprobs"] == new
    values = workers["critic"].dag_call(step, CallNode("critic_inf", ("actor_gen",)), gen)
    sources = ("actor_gen", "rew_inf", "ref_inf", "critic_inf")
    upstream = (gen, scores, ref, values)
    before = _digest(workers["actor"])
    held_out = workers["actor"].dag_call(step, CallNode("actor_train", sources, evaluate=True),
                                         *upstream)  # fmt: skip
    assert held_out.batch is None and held_out.stats == {}  # PPO reports no held-out metric
    assert _digest(workers["actor"]) == before, "evaluating does not update"
    trained = workers["actor"].dag_call(step, CallNode("actor_train", sources), *upstream)
    assert trained.batch is None and all(math.isfinite(v) for v in trained.stats.values())
    assert _digest(workers["actor"]) != before
    with pytest.raises(RuntimeError, match="call 'actor_train' reads 'values'"):
        workers["actor"].dag_call(step, CallNode("actor_train", sources[:3]), *upstream)


class _Wire:
    """A fake transfer group between two ranks of this process: a message per tag."""

    def __init__(self) -> None:
        self.messages: dict[int, torch.Tensor] = {}

    def shares(self, peer, n_bytes) -> bool:
        return False

    def begin(self, outgoing: list) -> None:
        pass  # no shared memory here

    def isend(self, t: torch.Tensor, peer: int, tag: int) -> _Wire:
        self.messages[tag] = t.clone()
        return self

    def forward(self, received, t, peer, tag):
        return self.isend(t, peer, tag)

    def irecv(self, t: torch.Tensor, peer: int, tag: int) -> _Wire:
        t.copy_(self.messages.pop(tag).view_as(t))
        return self

    def wait(self) -> None:
        pass


def _move(src: RoleWorker, dst: RoleWorker, step: StepInput, eta: float | None = None) -> int:
    """Move (or blend) ``src``'s weights into ``dst`` as the step DAG's nodes do."""
    plan = plan_realloc(src._model().module.spec, Layout((0,), 1), Layout((1,), 1))
    wire = _Wire()
    src.transfer_groups["g"] = dst.transfer_groups["g"] = wire  # type: ignore[assignment]
    sent = src.dag_send(step, MoveNode("realloc:x", "g", {1: plan.transfers}))
    got = dst.dag_recv(step, MoveNode("realloc:x", "g", {0: plan.transfers}, eta))
    assert sent.bytes == 0 and not wire.messages
    return got.bytes


def test_weights_move_into_a_released_copy_and_blend(workers, step):
    actor, ref = workers["actor"], workers["ref"]
    gen = actor.dag_call(step, CallNode("actor_gen", ()))
    ref.dag_call(step, CallNode("ref_inf", ("actor_gen",), release=True), gen)
    assert ref.weights_summary().bytes == 0, "a copy drops its weights after its call"
    with torch.no_grad():
        for p in actor._model().module.parameters():
            p.mul_(-2.0)
    full = actor.weights_summary().bytes
    assert _move(actor, ref, step) == full
    assert ref.weights_summary() == actor.weights_summary()
    old = {k: v.clone() for k, v in ref.get_weights().items()}
    with torch.no_grad():
        for p in actor._model().module.parameters():
            p.add_(1.0)
    assert _move(actor, ref, step, eta=0.25) == full
    new, source = ref.get_weights(), actor.get_weights()
    for name in old:
        assert torch.allclose(new[name], 0.25 * source[name] + 0.75 * old[name], atol=1e-6)


def test_the_whole_model_path_keeps_every_byte(workers):
    actor, critic = workers["actor"], workers["critic"]
    with torch.no_grad():
        for p in actor._model().module.parameters():
            p.mul_(3.0)
    weights = actor.get_weights()
    assert set(weights) and all(isinstance(t, torch.Tensor) for t in weights.values())
    assert workers["ref"].set_weights(weights) == actor.weights_summary().bytes
    assert workers["ref"].weights_summary() == actor.weights_summary()
    with pytest.raises(AssertionError, match="role 'reward' has no model"):
        workers["reward"].weights_summary()
    assert critic.weights_summary().bytes > 0


def test_checkpoints_write_the_model_and_one_optimizer_file_per_rank(workers, tmp_path):
    assert optim_file("/ck/optim", "critic", 3) == "/ck/optim/critic.rank3.pt"
    actor = workers["actor"]
    (tmp_path / "optim").mkdir()
    actor.save(str(tmp_path / "actor"), str(tmp_path / "optim"))
    assert (tmp_path / "actor" / "config.json").is_file()
    assert [p.name for p in (tmp_path / "optim").iterdir()] == ["actor.rank0.pt"]
    state = torch.load(tmp_path / "optim" / "actor.rank0.pt", weights_only=False)
    assert set(state) == {"interfaces", "optimizer"} and "ppo_actor" in state["interfaces"]
    actor.load_optimizer(str(tmp_path / "optim"))


def test_shutting_down_removes_the_worker_s_shared_memory_segments(workers):
    from rayhf.parallel.groups import host_store
    from rayhf.realloc import shm

    if not shm.available():
        pytest.skip("no writable /dev/shm")
    worker = workers["actor"]
    _store, address = host_store()
    worker.join_transfer_group("g", address, 0, 1)
    segments = worker.transfer_groups["g"].shm
    assert segments is not None and segments.marker.exists()
    segments.reserve(4096)
    owned = list(shm.SHM_DIR.glob(f"{shm.PREFIX}{segments.token}-*"))
    assert len(owned) == 2, owned  # the marker and the segment
    worker.shutdown()
    assert not list(shm.SHM_DIR.glob(f"{shm.PREFIX}{segments.token}-*"))


RANKS_WITHOUT_TRANSFORMERS = """
import pickle, sys
from rayhf.runtime.messages import CallNode
from rayhf.runtime.worker import RoleWorker

specs, step = pickle.load(open(sys.argv[1], "rb"))
actor, critic, reward = (RoleWorker(s) for s in specs)
for w in (actor, critic, reward):
    w.setup("tcp://127.0.0.1:1")
gen = actor.dag_call(step, CallNode("actor_gen", ()))
values = critic.dag_call(step, CallNode("critic_inf", ("actor_gen",)), gen)
assert values.batch.keys() == ["values"], values
scores = reward.dag_call(step, CallNode("rew_inf", ("actor_gen",)), gen)
assert scores.batch.keys() == ["scores"], scores
assert "transformers" not in sys.modules, "a model or reward function rank imported transformers"
"""


def test_model_ranks_generate_and_score_without_importing_transformers(workers, step, tmp_path):
    """transformers costs a worker process seconds of start-up: a rank reads what the driver
    rendered (its ``ModelFiles``, the tokenizer's ids), a reward function's rank decodes with
    the ``tokenizers`` library, and a rank imports it only for a chat template."""
    specs = [_spec(role, tmp_path) for role in ("actor", "critic", "reward")]
    (tmp_path / "in.pkl").write_bytes(pickle.dumps((specs, step)))
    run = subprocess.run(
        [sys.executable, "-c", RANKS_WITHOUT_TRANSFORMERS, str(tmp_path / "in.pkl")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
