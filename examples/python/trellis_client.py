#!/usr/bin/env python3
"""A Trellis job API client in Python: the proof that a client nobody on the team wrote speaks
the API. The gRPC stubs are generated from the repository's `proto/` at start (grpcio-tools), so
they always match the server.

    python trellis_client.py --server 127.0.0.1:7070 submit WORKFLOW.yaml [-o key=value] [--watch]
    python trellis_client.py --server 127.0.0.1:7070 watch JOB
    python trellis_client.py --server 127.0.0.1:7070 jobs

`--token-file DATA_DIR/token` sends the server's token (required off loopback); `--tls-ca CERT`
connects with TLS, trusting CERT. `submit --watch` and `watch` exit 0 when the job succeeds and
1 when it fails or is cancelled.
"""

import argparse
import importlib
import os
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parents[2] / "proto"


def load_stubs():
    """Generates the `trellis.v1` modules from proto/ into a temporary folder and imports the job API's."""
    import grpc_tools
    from grpc_tools import protoc

    out = tempfile.mkdtemp(prefix="trellis-stubs-")
    include = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            # job.proto imports the others (agent.proto for Resources, which imports tensor.proto).
            *sorted(str(p) for p in (PROTO_ROOT / "trellis" / "v1").glob("*.proto")),
        ]
    )
    if rc != 0:
        sys.exit(f"generating stubs from {PROTO_ROOT} failed")
    sys.path.insert(0, out)
    return (
        importlib.import_module("trellis.v1.job_pb2"),
        importlib.import_module("trellis.v1.job_pb2_grpc"),
    )


def channel(args):
    import grpc

    if args.tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(args.tls_ca).read_bytes())
        return grpc.secure_channel(args.server, creds)
    return grpc.insecure_channel(args.server)


def metadata(args):
    if not args.token_file:
        return ()
    token = Path(args.token_file).read_text().strip()
    return (("authorization", f"Bearer {token}"),)


def state_name(pb, state):
    return pb.JobState.Name(state).removeprefix("JOB_STATE_").lower()


def watch(pb, stub, md, job_id):
    """Prints the job's events until it ends; returns the exit status."""
    last = None
    for ev in stub.WatchJob(pb.WatchJobRequest(job_id=job_id), metadata=md):
        kind = ev.WhichOneof("event")
        if kind == "job":
            last = ev.job
            print(f"job {ev.job.id}: {state_name(pb, ev.job.state)}", flush=True)
        elif kind == "log":
            print(ev.log.text, flush=True)
        elif kind == "metrics":
            m = ev.metrics
            shown = {k: round(v, 4) for k, v in sorted(m.values.items()) if not k.startswith("timing_s/")}
            print(f"metrics {m.stage} step {m.step}: {shown}", flush=True)
    if last is None:
        return 1
    if last.state == pb.JOB_STATE_SUCCEEDED:
        return 0
    print(f"job {last.id} {state_name(pb, last.state)}: {last.error}", file=sys.stderr)
    return 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", default=os.environ.get("TRELLIS_SERVER", "127.0.0.1:7070"), help="HOST:PORT")
    p.add_argument("--token-file", default=os.environ.get("TRELLIS_TOKEN_FILE"))
    p.add_argument("--tls-ca", default=os.environ.get("TRELLIS_TLS_CA"))
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("submit", help="submit a workflow file")
    s.add_argument("file")
    s.add_argument("-o", "--override", action="append", default=[])
    s.add_argument("--watch", action="store_true")
    w = sub.add_parser("watch", help="stream a job's progress until it ends")
    w.add_argument("job", type=int)
    sub.add_parser("jobs", help="list the jobs")
    args = p.parse_args()

    import grpc

    pb, pb_grpc = load_stubs()
    stub = pb_grpc.JobServiceStub(channel(args))
    md = metadata(args)
    try:
        if args.command == "submit":
            path = Path(args.file).resolve()
            reply = stub.SubmitJob(
                pb.SubmitJobRequest(
                    workflow_yaml=path.read_text(),
                    overrides=args.override,
                    file_name=path.name,
                    base_dir=str(path.parent),
                ),
                metadata=md,
            )
            print(f"submitted job {reply.job_id} ({reply.job.name})", flush=True)
            return watch(pb, stub, md, reply.job_id) if args.watch else 0
        if args.command == "watch":
            return watch(pb, stub, md, args.job)
        for j in stub.ListJobs(pb.ListJobsRequest(), metadata=md).jobs:
            print(f"{j.id}\t{state_name(pb, j.state)}\t{j.name}\t{j.stage}\t{j.step}")
        return 0
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
