"""Reading back what the experiment-tracking sinks wrote: wandb's offline run files,
TensorBoard's event files, MLflow's file store."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32768  # wandb's run file: LevelDB's log format, records of wandb's protobuf Record


def wandb_runs(run_dir: Path) -> list[dict[str, Any]]:
    """Per offline run directory (oldest first): its run id, config and history rows."""
    from wandb.proto import wandb_internal_pb2

    runs = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        out: dict[str, Any] = {"id": None, "config": {}, "history": []}
        for raw in _records(path.read_bytes()):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(raw)
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                out["id"] = rec.run.run_id
                out["config"].update(
                    {u.key: json.loads(u.value_json) for u in rec.run.config.update}
                )
            elif kind == "history":
                items = rec.history.item  # a key is whole, or in nested_key's parts
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                out["history"].append(row)
        runs.append(out)
    return runs


def _records(data: bytes) -> list[bytes]:
    records, part, pos = [], b"", 7  # after the file's header
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header: padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            records.append(part)
            part = b""
    return records


def tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` as TensorBoard reads the run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def mlflow_runs(run_dir: Path) -> list[Any]:
    """Every MLflow run in the run directory's file store."""
    import os

    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    exps = [e.experiment_id for e in client.search_experiments()]
    return list(client.search_runs(exps))
