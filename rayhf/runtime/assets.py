"""Everything a run needs on disk, checked before any Ray process starts.

Bad input (a missing dataset, a too-long prompt, a directory that is not a model, a graph
mistake, an impossible plan) fails here with a one-line ``RayhfError``, so a run that starts
actors has already passed every check a user can fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from rayhf.algorithms.reward import resolve_function
from rayhf.config import ExperimentConfig
from rayhf.config.experiment import resolve_path
from rayhf.data.datasets import PromptDataset
from rayhf.errors import RayhfError
from rayhf.graph import Graph, load_graph
from rayhf.models.hf import build_model, hf_config, save_model
from rayhf.models.tokenizer import build_char_tokenizer
from rayhf.planner import Plan, make_plan


@dataclass
class RunAssets:
    """Resolved inputs of a run: files on disk and the validated graph, plan and dataset."""

    run_dir: Path
    graph: Graph
    plan: Plan
    dataset: PromptDataset
    tokenizer_dir: Path
    model_dirs: dict[str, Path]  # initial weights of every role that has a model
    trainable: set[str]  # roles with a train call


def prepare_tokenizer(cfg: ExperimentConfig, run_dir: Path):
    if cfg.tokenizer.alphabet is not None:
        out = run_dir / "tokenizer"
        return build_char_tokenizer(cfg.tokenizer.alphabet, out), out
    path = cfg.tokenizer.path
    if path is None and "actor" in cfg.models:
        path = cfg.models["actor"].path
    if path is None:
        raise RayhfError("tokenizer: set tokenizer.path or tokenizer.alphabet")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True), Path(path)
    except (OSError, ValueError) as e:
        raise RayhfError(f"tokenizer.path: cannot load a tokenizer from {path}: {e}") from None


def prepare_dataset(cfg: ExperimentConfig, tokenizer) -> PromptDataset:
    path = Path(cfg.dataset.path)
    if not path.exists() and cfg.dataset_builder:
        resolve_function(cfg.dataset_builder, "dataset_builder")(path)
    return PromptDataset.from_config(cfg.dataset, tokenizer)


def _check_model_dir(path: Path, field: str) -> None:
    if not (path / "config.json").is_file():
        raise RayhfError(f"{field}: {path} is not a model directory (no config.json)")
    try:
        AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise RayhfError(f"{field}: {path} is not a model: {str(e).splitlines()[0]}") from None


def prepare_models(cfg: ExperimentConfig, run_dir: Path, tokenizer) -> dict[str, Path]:
    """Initial weights per role: a given path, or a model created from ``init`` and saved."""
    dirs: dict[str, Path] = {}
    for role, rc in cfg.models.items():
        if rc.path is not None:
            _check_model_dir(Path(rc.path), f"models.{role}.path")
            dirs[role] = Path(rc.path)
        elif rc.init is not None:
            out = run_dir / "init" / role
            if not (out / "config.json").is_file():
                config = hf_config(
                    rc.init,
                    len(tokenizer),
                    tokenizer.pad_token_id,
                    tokenizer.bos_token_id,
                    tokenizer.eos_token_id,
                )
                model = build_model(config, rc.value_head, seed=rc.init.seed + 1000 * cfg.seed)
                save_model(model, out, tokenizer)
            dirs[role] = out
    for role, rc in cfg.models.items():
        if rc.init_from is not None:
            if rc.init_from not in dirs:
                raise RayhfError(
                    f"models.{role}.init_from: '{rc.init_from}' is not a role with a model"
                )
            dirs[role] = dirs[rc.init_from]
    return dirs


def prepare_run(cfg: ExperimentConfig, run_dir: Path) -> RunAssets:
    graph = load_graph(resolve_path(cfg.graph))
    graph.validate_roles(set(cfg.models))
    for c in graph.calls:
        if c.interface not in _interfaces():
            raise RayhfError(
                f"graph '{graph.name}': call '{c.name}' has unknown interface '{c.interface}'"
            )
    plan = make_plan(graph, cfg.plan, cfg.cluster)
    for role, rc in cfg.models.items():
        if rc.function is not None:
            resolve_function(rc.function, f"models.{role}.function")
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, tokenizer_dir = prepare_tokenizer(cfg, run_dir)
    dataset = prepare_dataset(cfg, tokenizer)
    model_dirs = prepare_models(cfg, run_dir, tokenizer)
    trainable = {c.role for c in graph.calls if c.kind == "train"}
    for role in trainable:
        if role not in model_dirs:
            raise RayhfError(f"models.{role}: role '{role}' is trained, so it needs a model")
    return RunAssets(run_dir, graph, plan, dataset, tokenizer_dir, model_dirs, trainable)


def _interfaces() -> set[str]:
    from rayhf.algorithms import INTERFACES

    return set(INTERFACES)
