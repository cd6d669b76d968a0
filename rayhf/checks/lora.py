"""Parity check of LoRA adapters on the small layouts against PEFT on the Hugging Face model.

``python -m rayhf.checks.lora OUT.json [--world 4]`` starts ``world`` gloo processes and, for
each precision and each dense case of ``rayhf.checks.parity`` on the layouts ``covering`` gives
it, wraps the case's tiny Hugging Face model with PEFT (rank 4 on every linear layer of its
decoder layers, B drawn at random so that the adapters change the output) and holds rayhf's
adapted model to it:

- ``logits``: forward logits, max abs error over max abs reference;
- ``grads``: the adapters' gradient shards after one training step (PEFT's model on all rows,
  under the same autocast; rayhf's on its replica's rows), over the largest reference gradient;
  in bf16 also both rayhf's and PEFT's logits and gradients against PEFT's in fp32
  (``logits_fp32``, ``grads_fp32``, ``peft_logits_fp32``, ``peft_grads_fp32``): how far each
  one's bf16 rounds;
- ``step``: the adapters after one AdamW step, gathered, max abs difference; ``frozen``: the
  largest change of any other weight (0: the base stays as it was);
- in fp32 on one replica split over tp or pp, ``decode``: greedy decoding after the step by
  the native decode step with the adapters merged into its lent weights against the same step
  adding them unmerged: the tokens that differ (``decode_differ``) and the largest log-prob
  difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayhf.checks.common import Tok
from rayhf.checks.parity import (
    CASES,
    PRECISIONS,
    _autocast,
    _batch,
    _loss,
    _model,
    _rel,
    _score_loss,
    _targets,
    covering,
    expert_split,
)
from rayhf.models.families import FAMILIES
from rayhf.models.lora import adapted, from_peft
from rayhf.models.spec import Lora, model_spec
from rayhf.parallel.groups import host_store, join_store, leave_spawned

RANK, ALPHA = 4, 8


def targets(case: str, head: bool = False) -> tuple[str, ...]:
    """The last names of every linear layer in the case's decoder layers, but those PEFT reads
    as the routed experts (``MoETraits.peft_fused``); with ``head``, "lm_head" after them where
    the case's head is its own (untied)."""
    moe = FAMILIES[CASES[case].family].moe
    model = _model(case, False)
    names = {
        name.rsplit(".", 1)[-1]
        for name, m in model.named_modules()
        if ".layers." in name or ".h." in name
        if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"
    }
    own = head and not model_spec(model.config, value_head=False).tied
    return (*sorted(names - set(moe.peft_fused if moe else ())), *(["lm_head"] if own else []))


def peft_model(case: str, precision: str = "fp32", head: bool = False):
    """The case's model wrapped by PEFT, its adapters drawn the same on every rank (``head``:
    its LM head's too). Below fp32
    it attends as rayhf does: with torch's fused kernel (Hugging Face's default), or in the
    eager form where scores are soft-capped (Gemma 2) or sinks join them (gpt-oss, which
    Hugging Face runs only so), as rayhf does then; in fp32 eagerly."""
    from peft import LoraConfig, get_peft_model

    conv1d = FAMILIES[CASES[case].family].block == "conv1d"  # GPT-2's weights are [in, out]
    config = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=list(targets(case, head)),
        fan_in_fan_out=conv1d,
    )
    base = _model(case, False)  # (its first build seeds torch's generator: then draw)
    eager = model_spec(base.config, False).attn_softcap is not None or not base._supports_sdpa
    if precision != "fp32" and not eager:
        base.set_attn_implementation("sdpa")
    torch.manual_seed(11)
    wrapped = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape) * 0.1)
    return wrapped


def _peft_step(case: str, precision: str, rows: slice) -> tuple[torch.Tensor, dict, dict]:
    """PEFT's side: its logits of ``rows`` and, after one clipped AdamW step on every row (both
    under ``precision``'s autocast), the adapters' gradients and values (rayhf's names)."""
    from rayhf.engines.torch_trainer import OptimizerConfig

    ids, mask = _batch()
    ref, opt = peft_model(case, precision, head=True), OptimizerConfig()
    with torch.no_grad(), _autocast(precision, "cpu"):
        want = ref(input_ids=ids[rows], attention_mask=mask[rows]).logits.float()
    trained = [p for p in ref.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW(trained, lr=opt.lr, betas=opt.betas, eps=opt.eps)
    with _autocast(precision, "cpu"):
        logits = ref(input_ids=ids, attention_mask=mask).logits.float()
    _loss(logits, ids, mask).backward()
    torch.nn.utils.clip_grad_norm_(trained, opt.grad_clip)
    ref_opt.step()
    named = from_peft(dict(ref.named_parameters()))
    grads = {k: v.grad for k, v in named.items() if v.grad is not None}
    return want, grads, {k: v.detach() for k, v in named.items()}


def _check(case: str, dp: int, tp: int, pp: int, rank: int, precision: str) -> dict | None:
    from rayhf.data.batch import PackedBatch
    from rayhf.engines.call import CallEngine
    from rayhf.engines.collectives import DataParallel
    from rayhf.engines.native import NativeGenerator
    from rayhf.engines.rank_model import RankModel
    from rayhf.engines.torch_trainer import OptimizerConfig, TorchTrainer
    from rayhf.models.hf import model_files
    from rayhf.models.precision import Numerics
    from rayhf.models.sharding import take_shard
    from rayhf.parallel.groups import build_groups

    groups = build_groups(dp, tp, pp, rank, ep=expert_split(case, dp, precision))
    if groups.coords.dp_rank < 0:
        return None
    ids, mask = _batch()
    rows = slice(groups.coords.dp_rank * 4 // dp, (groups.coords.dp_rank + 1) * 4 // dp)
    ref = peft_model(case, head=True)
    full = {k: v.clone() for k, v in from_peft(ref.state_dict()).items()}
    files = adapted(
        model_files(ref.base_model.model.config, False), Lora(RANK, ALPHA, targets(case, head=True))
    )
    model = RankModel(files, full, Tok(), groups=groups, numerics=Numerics(precision, master=True))
    engine = CallEngine(
        Tok(), model, DataParallel(groups.dp_group), NativeGenerator(model),
        TorchTrainer(model, OptimizerConfig()),
    )  # fmt: skip
    my_ids, my_mask = ids[rows], mask[rows]
    keep = my_mask.bool()
    with torch.no_grad():
        logits = engine.forward(my_ids, my_mask)[keep]
    targets_ = _targets(my_ids, my_mask)
    engine.train(
        [PackedBatch(list(range(len(my_ids))))],
        lambda _: (_score_loss(engine.score(my_ids, my_mask, targets_), my_mask), {}),
    )
    module, tp_rank = model.module, groups.coords.tp_rank
    adapters = {n: s for n, s in module.shards.items() if ".lora_" in n}
    mine = {n: module.param(n).grad for n in adapters}

    def grad_error(grads: dict) -> float:  # over the largest reference gradient
        scale = max(float(grads[n].abs().max()) for n in adapters)
        return max(
            float((g - take_shard(grads[n], adapters[n], tp, tp_rank)).abs().max()) / scale
            for n, g in mine.items()
            if g is not None
        )

    def norm_error(got: dict, ref: dict) -> float:  # over this rank's shards, all adapters
        mine_of = {n: take_shard(ref[n], adapters[n], tp, tp_rank) for n in adapters}
        pairs = [(got[n], mine_of[n]) for n in adapters if got.get(n) is not None]
        diff = torch.cat([(g - r).flatten() for g, r in pairs])
        return float(diff.norm() / torch.cat([r.flatten() for _, r in pairs]).norm())

    want, grads, after = _peft_step(case, precision, rows)
    whole = model.full_state()
    row = {
        "precision": precision, "family": case, "dp": dp, "tp": tp, "pp": pp, "rank": rank,
        "adapters": len(adapters), "no_grad": sum(g is None for g in mine.values()),
        "logits": _rel(logits, want[keep]), "grads": grad_error(grads),
        "step": max(float((whole[n] - after[n]).abs().max()) for n in adapters),
        "frozen": max(float((whole[n] - full[n]).abs().max()) for n in full if ".lora_" not in n),
        "trainable": sum(p.numel() for p in module.parameters() if p.requires_grad),
    }  # fmt: skip
    if precision == "fp32" and dp == 1 and tp * pp > 1:  # (split weights; dp repeats them)
        row["decode_differ"], row["decode"] = _merged_against_unmerged(model)
    if precision != "fp32":  # both against fp32's numbers: how far each precision's rounds
        exact, exact_grads, _ = _peft_step(case, "fp32", rows)
        row["logits_fp32"] = _rel(logits, exact[keep])
        row["grads_fp32"] = grad_error(exact_grads)
        row["peft_logits_fp32"] = _rel(want[keep], exact[keep])
        row["peft_grads_fp32"] = _rel_grads(grads, exact_grads, adapters)
        row["grads_fp32_norm"] = norm_error(mine, exact_grads)  # (relative L2, the same shards)
        row["peft_grads_fp32_norm"] = norm_error(
            {n: take_shard(grads[n], adapters[n], tp, tp_rank) for n in adapters}, exact_grads
        )
    return row


def _merged_against_unmerged(model: Any) -> tuple[int, float]:
    """Greedy tokens of a few prompts decoded with the adapters merged into the lent weights
    and unmerged: how many differ, and the largest log-prob difference."""
    from rayhf.parallel.decode import DecodeEngine, DecodeOptions
    from rayhf.sampling import DecodeRules, GenerationConfig

    cfg = GenerationConfig(max_new_tokens=4, min_new_tokens=4, greedy=True)
    rules, prompts = DecodeRules.of(cfg, model.eos_id, model.pad_id), [[3, 5, 7, 9], [4, 6]]
    merged, unmerged = (
        DecodeEngine(model.pipe, DecodeOptions(merge_adapters=m)).generate(prompts, rules, 0)
        for m in (True, False)
    )
    differ = sum(
        a != b
        for x, y in zip(merged.tokens, unmerged.tokens, strict=True)
        for a, b in zip(x, y, strict=True)
    )
    diff = torch.tensor(merged.logprobs) - torch.tensor(unmerged.logprobs)
    return differ, float(diff.abs().max())


def _rel_grads(got: dict, want: dict, names) -> float:
    scale = max(float(want[n].abs().max()) for n in names)
    return max(float((got[n] - want[n]).abs().max()) for n in names) / scale


def _worker(rank: int, world: int, address: str, out: str, checks: list) -> None:
    from rayhf.models.files import quiet_transformers

    torch.set_num_threads(1)
    quiet_transformers()
    dist.init_process_group("gloo", store=join_store(address), rank=rank, world_size=world)
    rows = []
    for precision, case, (dp, tp, pp) in checks:
        row = _check(case, dp, tp, pp, rank, precision)
        if row is not None:
            rows.append(row)
        dist.barrier()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(out, "w") as f:
            json.dump([r for part in gathered for r in part], f, indent=1)
    leave_spawned()


def run(out: str, world: int = 4, cases: list[str] | None = None) -> None:
    """Check ``cases`` (default: every case of the parity harness) on their covering layouts,
    both precisions, with ``world`` spawned ranks; the rows go to ``out``."""
    checks = covering(world, cases or list(CASES), PRECISIONS)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _store, address = host_store()
    mp.spawn(_worker, args=(world, address, out, checks), nprocs=world, join=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--case", nargs="*", default=None, help="default: every case")
    args = parser.parse_args(argv)
    run(args.out, args.world, args.case)


if __name__ == "__main__":
    main(sys.argv[1:])
