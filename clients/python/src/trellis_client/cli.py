"""`trellis-client`: the job API from a shell, with the `trellis` CLI's conventions — the same
`--server` / `TRELLIS_SERVER`, `--token-file` / `TRELLIS_TOKEN_FILE`, `--tls-ca` /
`TRELLIS_TLS_CA`, `--json` printing one object per line, and exit statuses (0 succeeded, 1
failed, 2 bad input or a refused call, 130 cancelled).

    trellis-client submit WORKFLOW.yaml [-o key=value ...] [--watch]
    trellis-client watch JOB | status JOB | cancel JOB | resume JOB [--watch]
    trellis-client jobs
    trellis-client metrics JOB [--from-row N]
    trellis-client wandb (RUN_DIR | --job JOB [--state FILE]) [--project P] [--entity E]
                         [--group G] [--follow]
        (a run's or a server job's metrics into Weights & Biases; needs `pip install wandb`)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from datetime import datetime

from ._client import Client, Job, JobState, LogLine, MetricRow, TrellisError

EXIT = {JobState.SUCCEEDED: 0, JobState.FAILED: 1, JobState.CANCELLED: 130}


def _plain(obj):
    if isinstance(obj, JobState):
        return obj.value
    if isinstance(obj, datetime):
        return obj.isoformat()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


def _json(kind: str, obj) -> str:
    d = _plain(asdict(obj))
    d.pop("workflow_json", None)
    return json.dumps({"event": kind, **d})


def _show(ev, as_json: bool) -> None:
    if isinstance(ev, Job):
        if as_json:
            print(_json("job", ev), flush=True)
        else:
            print(f"job {ev.id}: {ev.state.value}", flush=True)
    elif isinstance(ev, MetricRow):
        if as_json:
            print(_json("metrics", ev), flush=True)
        else:
            shown = {k: round(v, 4) for k, v in sorted(ev.values.items()) if not k.startswith("timing_s/")}
            print(f"metrics {ev.stage} step {ev.step}: {shown}", flush=True)
    elif isinstance(ev, LogLine):
        print(_json("log", ev) if as_json else ev.text, flush=True)


def _watch(c: Client, job_id: int, as_json: bool) -> int:
    last = None
    for ev in c.watch(job_id):
        _show(ev, as_json)
        if isinstance(ev, Job):
            last = ev
    if last is None or not last.state.ended:
        last = c.job(job_id)
    if last.state != JobState.SUCCEEDED and not as_json:
        print(f"job {last.id} {last.state.value}: {last.error}", file=sys.stderr)
    return EXIT.get(last.state, 1)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trellis-client", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--server", help="the server's URL (default: $TRELLIS_SERVER, else http://127.0.0.1:7070)")
    p.add_argument("--token-file", help="the server's DATA_DIR/token (the admin's) or a user's token file from `trellis user add` (default: $TRELLIS_TOKEN_FILE)")
    p.add_argument("--tls-ca", help="PEM certificate to trust for https:// (default: $TRELLIS_TLS_CA)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("submit", help="submit a workflow file")
    s.add_argument("file")
    s.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    s.add_argument("--watch", action="store_true", help="stream its progress until it ends")
    for name, what in (("watch", "stream a job's progress until it ends"), ("status", "show a job")):
        sub.add_parser(name, help=what).add_argument("job", type=int)
    sub.add_parser("cancel", help="stop a job after its current step").add_argument("job", type=int)
    r = sub.add_parser("resume", help="run a failed or cancelled job again from its checkpoint")
    r.add_argument("job", type=int)
    r.add_argument("--watch", action="store_true")
    sub.add_parser("jobs", help="list the jobs")
    m = sub.add_parser("metrics", help="a job's metric rows")
    m.add_argument("job", type=int)
    m.add_argument("--from-row", type=int, default=0)
    w = sub.add_parser("wandb", help="log a run directory's metrics to Weights & Biases (WANDB_MODE=offline: for `wandb sync`)")
    w.add_argument("run_dir", nargs="?", help="a run directory (or --job)")
    w.add_argument("--job", type=int, help="a server job, read through the API")
    w.add_argument("--state", help="--job: where the logged steps are kept (default trellis-wandb-job-JOB.json)")
    w.add_argument("--project", help="wandb project (default: the workflow's name)")
    w.add_argument("--entity", help="wandb entity (default: wandb's)")
    w.add_argument("--group", help="wandb group of the stages' runs (default: the run directory's name)")
    w.add_argument("--follow", action="store_true", help="keep logging while the run goes, until it ends")
    return p


def _wandb(args) -> int:
    try:
        import wandb  # noqa: F401
    except ImportError:
        print("error: the wandb sidecar needs the wandb package: pip install wandb", file=sys.stderr)
        return 2
    from .wandb_sync import sync, sync_job

    if (args.run_dir is None) == (args.job is None):
        print("error: give a run directory or --job JOB", file=sys.stderr)
        return 2
    if args.job is not None:
        with Client(args.server, token_file=args.token_file, tls_ca=args.tls_ca) as c:
            logged = sync_job(c, args.job, state_path=args.state, project=args.project,
                              entity=args.entity, group=args.group, follow=args.follow)
    else:
        logged = sync(args.run_dir, project=args.project, entity=args.entity, group=args.group,
                      follow=args.follow)
    if args.json:
        print(json.dumps({"logged": logged}))
    else:
        for stage, n in logged.items():
            print(f"{stage}: {n} rows logged")
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "wandb":
            return _wandb(args)
        with Client(args.server, token_file=args.token_file, tls_ca=args.tls_ca) as c:
            if args.command == "submit":
                job = c.submit(args.file, args.override)
                if args.json:
                    print(_json("job", job), flush=True)
                else:
                    print(f"submitted job {job.id} ({job.name})", flush=True)
                return _watch(c, job.id, args.json) if args.watch else 0
            if args.command == "watch":
                return _watch(c, args.job, args.json)
            if args.command == "status":
                job = c.job(args.job)
                if args.json:
                    print(_json("job", job))
                else:
                    print(f"{job.id}\t{job.state.value}\t{job.name}\t{job.stage}\t{job.step}\t{job.run_dir}")
                    if job.error:
                        print(job.error)
                return 0
            if args.command in ("cancel", "resume"):
                job = (c.cancel if args.command == "cancel" else c.resume)(args.job)
                _show(job, args.json)
                if args.command == "resume" and args.watch:
                    return _watch(c, job.id, args.json)
                return 0
            if args.command == "jobs":
                for j in c.jobs():
                    print(_json("job", j) if args.json else f"{j.id}\t{j.state.value}\t{j.name}\t{j.stage}\t{j.step}")
                return 0
            for row in c.metrics(args.job, args.from_row):
                _show(row, True) if args.json else print(json.dumps({"row": row.row, "stage": row.stage, "step": row.step, **row.values}))
            return 0
    except TrellisError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
