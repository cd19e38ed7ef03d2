"""What each tracker wrote, read back with the tracker's own reader where it has one: every scalar as
{(tag, step): [values, in the order logged]}."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def mlflow_runs(uri: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def mlflow_scalars(uri: str, run_id: str) -> dict[tuple[str, int], list[float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    out: dict[tuple[str, int], list[float]] = {}
    for key in client.get_run(run_id).data.metrics:
        for metric in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp):
            out.setdefault((key, metric.step), []).append(metric.value)
    return out


def tensorboard_scalars(folder: Path) -> dict[tuple[str, int], list[float]]:
    """As TensorBoard shows them: events of a later session purge the earlier ones' from its first step on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    events.Reload()
    out: dict[tuple[str, int], list[float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            out.setdefault((tag, event.step), []).append(event.value)
    return out


def tensorboard_tags(folder: Path, kind: str) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"tensors": 0, "images": 0})
    events.Reload()
    return events.Tags()[kind]


def wandb_records(path: Path):
    """The records of an offline run's ``run-<id>.wandb``: W&B's header (``:W&B``, magic, version), then LevelDB's
    log format (32 KiB blocks; each record a 7-byte header: CRC32C, length, type full/first/middle/last) of
    ``wandb_internal_pb2.Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    position, pending = 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if length == 0 and kind == 0:
            position += block - position % block
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # full, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_runs(folder: Path) -> list[Path]:
    """The offline runs' files under a W&B directory, oldest first."""
    return sorted(folder.glob("wandb/offline-run-*/run-*.wandb"))


def wandb_scalars(files: list[Path]) -> dict[tuple[str, int], list[float]]:
    out: dict[tuple[str, int], list[float]] = {}
    for path in files:
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):
                        out.setdefault((key, record.history.step.num), []).append(json.loads(item.value_json))
    return out


def wandb_run(path: Path):
    """The run record (id, name, group, config) of an offline run's file."""
    return next(r.run for r in wandb_records(path) if r.WhichOneof("record_type") == "run")
