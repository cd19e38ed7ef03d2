"""The scalars of one round's record of ``metrics.jsonl`` (:mod:`.run_log`), named as TensorBoard, MLflow and W&B
show them.  The live trackers (:mod:`.tracking`) and ``python -m mpifl.report --tensorboard`` both use this one
naming, so a run's live view and its view after the fact agree.

Step = the record's round; ``<score>`` is the task's (``acc``, ``dice`` for segmentation):

* ``train/loss``, ``train/<score>`` (%) and, under ``--select-by local-val``, ``train/local_val_acc`` (%);
* ``bytes/<down|up|wire_down|wire_up>``, ``seconds/<round|compute|...>``, as the record holds them;
* with a simulated clock (docs/clients.md), ``sim/seconds`` (the round's) and ``sim/time`` (at its end);
* on evaluation rounds, ``<kind>/test_<score>/<domain>`` (%), ``<kind>/test_loss/<domain>`` and
  ``<kind>/val_<score>/<domain>`` (%), ``<domain>`` ``mean`` too; kind ``global`` or ``personal``.

Left out, as no single number: the round's client ids, the per-rank lists (``rank_seconds``, ``memory``) and the
per-client scores.
"""

from __future__ import annotations


def scalars(record: dict, score: str) -> dict[str, float]:
    """Tag -> value of one record (accuracies and Dice scores in %, everything else as the record holds it)."""
    out = {}
    for key, value in record.get("train", {}).items():  # loss, and fractions: the score, local_val_acc
        out[f"train/{key}"] = float(value) * (1 if key == "loss" else 100)
    out.update((f"bytes/{k}", float(v)) for k, v in record.get("bytes", {}).items())
    out.update((f"seconds/{k}", float(v)) for k, v in record.get("seconds", {}).items())
    out.update((f"sim/{k}", float(record["sim"][k])) for k in ("seconds", "time") if k in record.get("sim", {}))
    for kind, splits in record.get("eval", {}).items():
        for split, metrics in (("test", (score, "loss")), ("val", (score,))):
            found = splits.get(split, {})
            for domain, values in {"mean": found.get("mean", {}), **found.get("domains", {})}.items():
                for metric in metrics:
                    if metric in values:
                        scale = 100 if metric == score else 1
                        out[f"{kind}/{split}_{metric}/{domain}"] = scale * float(values[metric])
    return out
