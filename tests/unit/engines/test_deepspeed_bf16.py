"""DeepSpeed's bf16 mode on one rank, in a subprocess (DeepSpeed keeps process-wide state):
the rank's weights are bf16, ZeRO-1, 2 and 3 step them from an fp32 master copy, and weights
written from outside become the master copy."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, torch
from rayhf.checks.common import Tok, tiny_model
from rayhf.checks.parity import _batch, _loss
from rayhf.data.batch import PackedBatch
from rayhf.engines.config import DeepSpeedEngineConfig
from rayhf.engines.deepspeed_trainer import DeepSpeedTrainer
from rayhf.engines.rank_model import RankModel
from rayhf.engines.torch_trainer import OptimizerConfig
from rayhf.models.precision import Numerics

out = {}
ids, mask = _batch()
for stage in (1, 2, 3):
    hf = tiny_model("llama", {"n_heads": 4})
    model = RankModel.from_hf(hf, Tok(), False, numerics=Numerics("bf16"))
    engine = DeepSpeedEngineConfig(zero_stage=stage)
    trainer = DeepSpeedTrainer(model, OptimizerConfig(lr=1e-2), engine)
    held = trainer.shard_source().source_shards()
    before = {k: v.detach().float().clone() for k, v in held.items()}
    loss = lambda _: (_loss(model.forward(ids, mask), ids, mask), {})
    trainer.train([PackedBatch(list(range(len(ids))))], loss)
    after = trainer.shard_source().source_shards()
    row = {
        "dtypes": sorted({str(v.dtype) for v in after.values()}),
        "moved": max(float((after[k].detach().float() - v).abs().max()) for k, v in before.items()),
        "master": type(trainer.ds.optimizer).__name__,
    }
    if stage < 3:  # weights from outside (a reallocation) become the master copy
        with torch.no_grad():
            for p in model.module.parameters():
                p.fill_(0.5)
        trainer.weights_loaded()
        trainer.train([PackedBatch(list(range(len(ids))))], loss)
        near = [float((p.detach().float() - 0.5).abs().max()) for p in model.module.parameters()]
        row["after_load"] = max(near)
    out[stage] = row
print("ROWS" + json.dumps(out))
"""


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs DeepSpeed")
def test_bf16_deepspeed_steps_bf16_weights_from_an_fp32_master():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=True
    )
    line = next(x for x in done.stdout.splitlines() if x.startswith("ROWS"))
    rows = json.loads(line.removeprefix("ROWS"))
    for stage, row in rows.items():
        assert row["dtypes"] == ["torch.bfloat16"], (stage, row)
        assert row["moved"] > 1e-3, f"ZeRO-{stage} did not step"
    # one step at lr 1e-2 from the loaded 0.5s: the master copy started from them, not from
    # the weights before the load
    assert rows["1"]["after_load"] < 0.05 and rows["2"]["after_load"] < 0.05
