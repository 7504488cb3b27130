"""A Trellis run's metrics into Weights & Biases, the way wandb users already sync runs: this
logs them with the `wandb` package (installed separately: `pip install wandb`), online or — with
`WANDB_MODE=offline` — into `./wandb/offline-run-*` for a later `wandb sync`.

    trellis-client wandb RUN_DIR [--project P] [--entity E] [--group G] [--follow]
    trellis-client [--server URL] wandb --job ID [--state FILE] [...]   (a server's job, through the API)

Layout, as TensorBoard's and MLflow's: one wandb run per stage (named after the stage, `job_type`
the stage), grouped under the run directory's name, with the resolved workflow
(`RUN_DIR/workflow.json`) as its config and the stage's own steps, so curves overlay a VeRL run's
(`critic/score/mean`, `actor/pg_loss`, ...). `--follow` keeps reading while the run goes (its
`status.json` exists) and ends when it ends.

`RUN_DIR/wandb.json` keeps each stage's wandb run id and last step logged: syncing again (after
more steps, or after a kill and `trellis resume`) logs into the same runs, every step once. A
server's job is read through the job API (its metric rows, watched until it ends with
`--follow`); its state file defaults to `trellis-wandb-job-ID.json` in the current folder.
"""

from __future__ import annotations

import json
import os
import time
from typing import Dict, Iterator, Optional


def _rows(run_dir: str, follow: bool, poll: float = 0.5) -> Iterator[dict]:
    """The run's metric rows in order; with `follow`, new ones too until the run ends. A resume
    rewinds `metrics.jsonl` to its checkpoint: reading starts over (steps already logged are
    skipped by the caller)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    live = os.path.join(run_dir, "status.json")
    offset = 0
    while True:
        running = os.path.exists(live)
        if os.path.exists(path):
            if os.path.getsize(path) < offset:
                offset = 0
            with open(path, encoding="utf-8") as f:
                f.seek(offset)
                while True:
                    line = f.readline()
                    if not line.endswith("\n"):
                        break  # a row being written: read it whole next time
                    offset = f.tell()
                    if line.strip():
                        yield json.loads(line)
        if not follow or (not running and os.path.exists(path)):
            return
        time.sleep(poll)


def sync(
    run_dir: str,
    project: Optional[str] = None,
    entity: Optional[str] = None,
    group: Optional[str] = None,
    follow: bool = False,
) -> Dict[str, int]:
    """Logs `run_dir`'s metrics to wandb; returns the rows logged per stage."""
    run_dir = os.path.abspath(run_dir)
    if not os.path.isdir(run_dir):
        raise ValueError(f"{run_dir}: no such run directory")
    if not follow and not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        raise ValueError(f"{run_dir}: no metrics.jsonl (not a Trellis run directory, or nothing ran yet)")
    config = {}
    workflow = os.path.join(run_dir, "workflow.json")
    if os.path.exists(workflow):
        with open(workflow, encoding="utf-8") as f:
            config = json.load(f)
    return _log(_rows(run_dir, follow), config, os.path.join(run_dir, "wandb.json"), project, entity,
                group or os.path.basename(run_dir))


def sync_job(
    client,
    job_id: int,
    state_path: Optional[str] = None,
    project: Optional[str] = None,
    entity: Optional[str] = None,
    group: Optional[str] = None,
    follow: bool = False,
) -> Dict[str, int]:
    """Logs a server job's metrics to wandb through the job API (`client`: a
    `trellis_client.Client`); with `follow`, until the job ends."""
    from ._client import MetricRow

    job = client.job(job_id)
    config = json.loads(job.workflow_json) if job.workflow_json else {}
    if follow:
        rows = ({"stage": e.stage, "step": e.step, **e.values} for e in client.watch(job_id)
                if isinstance(e, MetricRow))
    else:
        rows = ({"stage": r.stage, "step": r.step, **r.values} for r in client.metrics(job_id))
    return _log(rows, config, state_path or f"trellis-wandb-job-{job_id}.json", project, entity,
                group or f"job-{job_id}")


def _log(rows, config: dict, state_path: str, project, entity, group) -> Dict[str, int]:
    """Logs `rows` (dicts with `stage`, `step` and the metrics) to one wandb run per stage,
    skipping steps `state_path` says were logged; returns the rows logged per stage."""
    import wandb  # the sidecar's one extra dependency, imported only here

    state: Dict[str, dict] = {}
    if os.path.exists(state_path):
        with open(state_path, encoding="utf-8") as f:
            state = json.load(f)
    project = project or config.get("name") or "trellis"
    runs = {}
    logged: Dict[str, int] = {}

    def save() -> None:
        tmp = state_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(state, f, indent=1)
        os.replace(tmp, state_path)

    try:
        for row in rows:
            stage, step = row.pop("stage"), row.pop("step")
            known = state.setdefault(stage, {})
            if known.get("last_step") is not None and step <= known["last_step"]:
                continue
            run = runs.get(stage)
            if run is None:
                run = wandb.init(
                    project=project,
                    entity=entity,
                    group=group,
                    name=stage,
                    job_type=stage,
                    config=config,
                    id=known.get("id"),
                    resume="allow",
                    reinit="create_new",
                )
                runs[stage] = run
                known["id"] = run.id
            run.log(row, step=step)
            known["last_step"] = step
            logged[stage] = logged.get(stage, 0) + 1
            save()
    finally:
        for run in runs.values():
            run.finish()
    return logged
