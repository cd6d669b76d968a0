"""A run's live Ray side: the cluster, the device placement group and the role groups.

``Session`` is a context manager: whatever happens inside (an error, Ctrl-C), leaving it kills
the actors, removes the placement group and stops an embedded Ray cluster.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import ray

from rayhf.algorithms import InterfaceSettings
from rayhf.config import ExperimentConfig
from rayhf.config.faults import FaultInjection
from rayhf.models.files import ADAPTER_DIR, ModelFiles
from rayhf.models.precision import Numerics, resolve
from rayhf.parallel.layout import Layout
from rayhf.realloc.mover import ReallocStats, TransferGroupMover
from rayhf.runtime.assets import RunAssets
from rayhf.runtime.checkpoint import read_state
from rayhf.runtime.cluster import DeviceCluster, connect, reserve_devices
from rayhf.runtime.driver import Placement
from rayhf.runtime.messages import CallSpec, WorkerSpec
from rayhf.runtime.planning import step_options
from rayhf.runtime.role_group import RoleGroup
from rayhf.runtime.waits import group_wait


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Ctrl-C inside waits for the block to end, then raises ``KeyboardInterrupt``: a teardown
    stopped half way would leave processes behind, and one that dropped the signal (SIG_IGN)
    would let a run that was being recovered go on as if nobody had asked it to stop."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    except BaseException as e:
        if caught and not isinstance(e, KeyboardInterrupt):
            raise KeyboardInterrupt from e
        raise
    finally:  # a handler installed outside Python reads as None: Python's own then
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
    if caught:
        raise KeyboardInterrupt


class Session:
    def __init__(
        self,
        cfg: ExperimentConfig,
        assets: RunAssets,
        resume: Path | None,
        inject: FaultInjection | None = None,
        devices_timeout_s: float | None = None,
    ) -> None:
        """``resume``: the checkpoint the role groups load; ``inject``: a fault their actors
        carry; ``devices_timeout_s``: wait this long for the cluster to have the devices (a
        recovery: a node may be on its way back) instead of failing at once."""
        self.cfg, self.assets, self.resume = cfg, assets, resume
        self.inject, self.devices_timeout_s = inject, devices_timeout_s
        self.groups: dict[str, RoleGroup] = {}  # role -> its home group (weights, optimizer)
        self.copies: dict[str, RoleGroup] = {}  # group key -> a role's group in another layout
        self.timeout_s = cfg.driver.call_timeout_s  # the longest any wait on the actors takes
        self.mover = TransferGroupMover(
            wait=group_wait(self.timeout_s),
            shm=cfg.driver.moves_through_shm,
            ipc=cfg.driver.moves_through_ipc,
        )
        self.devices: DeviceCluster | None = None
        self.namespace = f"rayhf-{cfg.name}-{uuid.uuid4().hex[:6]}"
        self.init_realloc: ReallocStats | None = None
        self._files: dict[tuple[str, bool], ModelFiles] = {}  # by (directory, value head)
        self._adapter_configs: dict[str, str] = {}  # PEFT's adapter_config.json, by role

    def __enter__(self) -> Session:
        try:
            started = connect(self.cfg.cluster)
            self.devices = reserve_devices(self.cfg.cluster, started, self.devices_timeout_s)
            self._start_groups()
        except BaseException:
            self.close(graceful=False)
            raise
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self.close(graceful=kind is None)

    def all_groups(self) -> list[RoleGroup]:
        return [*self.groups.values(), *self.copies.values()]

    def placement(self) -> Placement:
        plan, graph = self.assets.plan, self.assets.graph
        return Placement(
            {g.key: g for g in self.all_groups()},
            {c.name: plan.layouts[c.name] for c in graph.calls},
            {role: g.layout for role, g in self.groups.items()},
            self.assets.specs,
            self.mover,
            step_options(self.cfg).with_lora(self.assets.specs, plan.released),
        )

    def close(self, graceful: bool = True) -> None:
        """Kill the actors, free the devices, stop an embedded cluster; Ctrl-C meanwhile waits
        until this is done (it would leave processes behind), then interrupts. ``graceful``:
        let the actors leave their process groups first (after a failure they may be stuck in
        a collective with a dead peer: they are killed at once)."""
        with _interrupts_deferred():
            self._close(graceful)

    def _close(self, graceful: bool) -> None:
        for group in self.all_groups():
            if graceful:
                with contextlib.suppress(Exception):  # a dead actor must not stop the cleanup
                    ray.get([a.shutdown.remote() for a in group.actors], timeout=10)
            group.kill()
        self.groups, self.copies = {}, {}
        if self.devices is not None:
            self.devices.close()
            self.devices = None

    def _start_groups(self) -> None:
        """One role group per distinct (role, layout); the first of a role is its home."""
        assert self.devices is not None
        layouts = self.assets.plan.role_layouts(self.assets.graph)
        per_device: dict[int, int] = {}
        for role_layouts in layouts.values():
            for layout in role_layouts:
                for d in layout.mesh:
                    per_device[d] = per_device.get(d, 0) + 1
        share = 1.0 / max(per_device.values())
        threads = max(1, int(self.devices.cpus_per_device))
        for role, role_layouts in layouts.items():
            for layout in role_layouts:
                group = RoleGroup(
                    role,
                    layout,
                    functools.partial(self._spec, role, layout, threads=threads),
                    self.devices,
                    share,
                    self.namespace,
                    flat=self._zero3(role, layout),
                    dtype=self.numerics(role, layout).storage_name,
                    timeout_s=self.timeout_s,
                )
                self.groups.setdefault(role, group)
                if group is not self.groups[role]:
                    self.copies[group.key] = group
        for group in self.all_groups():
            group.setup()
        self._init_copies()
        if self.resume is not None:
            for role in sorted(self.assets.trainable):
                path = str(self.resume / "optim")
                self.groups[role].call_all("checkpoint restore", "load_optimizer", path)

    def _init_copies(self) -> None:
        """A fresh run's ``init_from`` roles get their weights by reallocation from the source."""
        if self.resume is not None:
            return
        for role, rc in self.cfg.models.items():
            if rc.init_from is not None and role in self.groups:
                src, dst = self.groups[rc.init_from], self.groups[role]
                spec = self.assets.specs[role]
                self.init_realloc = self.mover.move(src, dst, spec)

    def _zero3(self, role: str, layout: Layout) -> bool:
        """Whether this role group trains with DeepSpeed ZeRO-3 (its ranks hold flat slices)."""
        plan, graph = self.assets.plan, self.assets.graph
        return any(
            c.role == role
            and c.kind == "train"
            and plan.layouts[c.name] == layout
            and self.cfg.engine_of(c.name, c.kind).zero_stage_for(False) == 3
            for c in graph.calls
        )

    def _spec(self, role: str, layout: Layout, rank: int, *, threads: int) -> WorkerSpec:
        cfg, assets = self.cfg, self.assets
        rc = cfg.models[role]
        model_dir, config_dir = self._weights_source(role)
        shape_dir = model_dir or config_dir
        home = assets.plan.home_layouts(assets.graph)[role] == layout
        calls = tuple(
            CallSpec(
                c.name,
                c.kind,
                c.interface,
                dict(c.args),
                c.interface_inputs(),
                c.interface_outputs(),
                cfg.engine_of(c.name, c.kind),
                base=c.base,
            )
            for c in assets.graph.calls
            if c.role == role and assets.plan.layouts[c.name] == layout
        )
        # the schedule's decay ends at the run's last step unless it names its own
        schedule = rc.optimizer.schedule
        if schedule.total_steps is None:
            schedule = schedule.model_copy(update={"total_steps": cfg.steps})
        optimizer = rc.optimizer.model_copy(update={"schedule": schedule})
        return WorkerSpec(
            role=role,
            layout_name=layout.name,
            rank=rank,
            dp_size=layout.dp,
            tp_size=layout.tp,
            pp_size=layout.pp,
            ep_size=layout.ep,
            cp_size=layout.cp,
            n_microbatches=layout.n_microbatches,
            calls=calls,
            settings=InterfaceSettings(
                cfg.algorithm, cfg.generation, rc.function, cfg.env, cfg.judge
            ),
            tokenizer_dir=str(assets.tokenizer_dir.resolve()),
            special_ids=assets.special_ids,
            model=None if shape_dir is None else self._model_files(shape_dir, rc.value_head, role),
            model_dir=model_dir,
            adapter_dir=self._adapter_dir(role, model_dir),
            value_head=rc.value_head,
            optimizer=optimizer if role in assets.trainable and home else None,
            activation_checkpointing=rc.activation_checkpointing,
            numerics=self.numerics(role, layout),
            seed=cfg.seed,
            threads=threads,
            device="cuda" if cfg.cluster.device == "cuda" else "cpu",
            fault=self._fault(role, rank),
            version=self.start_step,
        )

    def _model_files(self, path: str, value_head: bool, role: str) -> ModelFiles:
        """The shape and saved form of the model in ``path``, for the role's workers (which
        read and write its files without importing transformers); read once per session."""
        from rayhf.models.hf import model_files, read_model_config

        key = (path, value_head)
        if key not in self._files:
            config = read_model_config(path, value_head, f"models.{role}")
            self._files[key] = model_files(config, value_head, path)
        lora = self.assets.loras.get(role)
        if lora is None:
            return self._files[key]
        from rayhf.models.lora import adapted, adapter_config_text

        if role not in self._adapter_configs:  # rendered by peft, once
            conv1d = self._files[key].spec.traits.block == "conv1d"
            self._adapter_configs[role] = adapter_config_text(lora, path, conv1d)
        return adapted(self._files[key], lora, self._adapter_configs[role])

    def _adapter_dir(self, role: str, model_dir: str | None) -> str | None:
        """Where a LoRA role's first adapters come from: a resumed checkpoint's, else
        ``models.<role>.lora.adapter``; None: PEFT's fresh ones."""
        lora = self.cfg.models[role].lora
        if lora is None or model_dir is None:
            return None
        if self.resume is not None:
            saved = Path(model_dir) / ADAPTER_DIR
            return str(saved) if saved.is_dir() else None
        return None if lora.adapter is None else str(Path(lora.adapter).resolve())

    @functools.cached_property
    def start_step(self) -> int:
        """The step whose update made the weights the groups start with (a resume's)."""
        return int(read_state(self.resume)["step"]) if self.resume is not None else 0

    def _fault(self, role: str, rank: int) -> FaultInjection | None:
        """The injected fault, for the rank it names in each of its role's groups."""
        inject = self.inject
        return inject if inject is not None and (inject.role, inject.rank) == (role, rank) else None

    def numerics(self, role: str, layout: Layout) -> Numerics:
        """How a role's copy on ``layout`` computes: fp32 master weights where it trains on the
        torch engine (its home layout) or blends (a moving-average role), the low dtype
        elsewhere; an engine that trains in the compute dtype (DeepSpeed) keeps its fp32 master
        copy in its optimizer."""
        rc, assets, cfg = self.cfg.models[role], self.assets, self.cfg
        device = "cuda" if cfg.cluster.device == "cuda" else "cpu"
        trains = role in assets.trainable and assets.plan.home_layouts(assets.graph)[role] == layout
        master_in_optimizer = any(
            c.role == role
            and c.kind == "train"
            and cfg.engine_of(c.name, c.kind).trains_in_compute_dtype
            for c in assets.graph.calls
        )
        master = (trains and not master_in_optimizer) or rc.ema is not None
        return Numerics(resolve(rc.precision, device), master, rc.fp32_lm_head)

    def _weights_source(self, role: str) -> tuple[str | None, str | None]:
        """(model_dir, config_dir): where a role's first weights come from."""
        rc, assets = self.cfg.models[role], self.assets
        if rc.function is not None:
            return None, None
        if self.resume is not None and role in assets.trainable:
            return str((self.resume / role).resolve()), None
        source = str(assets.model_dirs[role].resolve())  # actors may run in another directory
        if rc.init_from is not None and self.resume is None:
            return None, source  # weights arrive by reallocation
        return source, None
