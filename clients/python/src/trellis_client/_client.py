"""The job API client: typed wrappers over the generated gRPC stubs."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import grpc

from ._proto import job_pb2, job_pb2_grpc

#: Where `trellis serve` listens by default (the CLI's `--server` default).
DEFAULT_SERVER = "http://127.0.0.1:7070"


class JobState(enum.Enum):
    """Where a job is."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        """Succeeded, failed or cancelled (a failed or cancelled job can be resumed)."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)

    @classmethod
    def _from_pb(cls, value: int) -> "JobState":
        name = job_pb2.JobState.Name(value).removeprefix("JOB_STATE_").lower()
        if name == "unspecified":
            raise TrellisError("UNKNOWN", "the server sent a job without a state")
        return cls(name)


def _time(ms: int) -> Optional[datetime]:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc) if ms else None


@dataclass(frozen=True)
class Job:
    """A job as the server last reported it."""

    id: int
    name: str
    state: JobState
    #: Why it failed or how it was stopped; empty otherwise.
    error: str
    created: Optional[datetime]
    updated: Optional[datetime]
    stages_completed: List[str]
    #: Stage and step of its latest metric row.
    stage: str
    step: int
    #: Its latest checkpoint: stage, step, folder (relative to `run_dir`), weight version.
    checkpoint_stage: str
    checkpoint_step: int
    checkpoint: str
    weight_version: int
    #: Its run directory on the server.
    run_dir: str
    #: A cancel was asked and the job is finishing its current step.
    cancel_requested: bool
    #: The user who submitted it (`trellis user add`); empty for the server's admin.
    owner: str = ""
    #: The resolved workflow as JSON text (from `submit` and `job` only; empty otherwise).
    workflow_json: str = field(repr=False, default="")

    @classmethod
    def _from_pb(cls, j) -> "Job":
        return cls(
            id=j.id,
            name=j.name,
            state=JobState._from_pb(j.state),
            error=j.error,
            created=_time(j.created_ms),
            updated=_time(j.updated_ms),
            stages_completed=list(j.stages_completed),
            stage=j.stage,
            step=j.step,
            checkpoint_stage=j.checkpoint_stage,
            checkpoint_step=j.checkpoint_step,
            checkpoint=j.checkpoint,
            weight_version=j.weight_version,
            run_dir=j.run_dir,
            cancel_requested=j.cancel_requested,
            owner=j.owner,
            workflow_json=j.workflow_json,
        )


@dataclass(frozen=True)
class MetricRow:
    """One step's metrics, under VeRL's names (`critic/score/mean`, `actor/pg_loss`, ...)."""

    #: Position in the job's record (a resumed job's repeated steps come again with new rows).
    row: int
    stage: str
    step: int
    values: Dict[str, float]


@dataclass(frozen=True)
class LogLine:
    """A progress line of the job, as `trellis train` prints it."""

    line: int
    time: Optional[datetime]
    text: str


#: What `watch` yields: the job (first as it is, then on every change of state or checkpoint),
#: its metric rows and its log lines, in the order they happen.
Event = Union[Job, MetricRow, LogLine]


class TrellisError(Exception):
    """The server refused a call or could not be reached; `code` is the gRPC status name
    (`INVALID_ARGUMENT` for a bad workflow, `NOT_FOUND`, `UNAUTHENTICATED`, `UNAVAILABLE`, ...)."""

    def __init__(self, code: str, details: str):
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


def _error(e: grpc.RpcError) -> TrellisError:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    return TrellisError(code.name if code is not None else "UNKNOWN", details or "")


def _target(server: str) -> Tuple[str, bool]:
    """`http://HOST:PORT` → (HOST:PORT, no TLS); `https://HOST:PORT` → (HOST:PORT, TLS); a bare
    `HOST:PORT` is plain HTTP."""
    for scheme, tls in (("https://", True), ("http://", False)):
        if server.startswith(scheme):
            rest = server[len(scheme) :].rstrip("/")
            if not rest or "/" in rest:
                raise ValueError(f"server `{server}` is not a URL like {DEFAULT_SERVER}")
            return rest, tls
    if "://" in server:
        raise ValueError(f"server `{server}`: only http:// and https:// URLs are served")
    return server, False


class Client:
    """A connection to `trellis serve`.

    `server`, `token_file` and `tls_ca` default to what the `trellis` CLI reads:
    `TRELLIS_SERVER` (else http://127.0.0.1:7070), `TRELLIS_TOKEN_FILE` (the server's
    DATA_DIR/token, needed off loopback) and `TRELLIS_TLS_CA` (a PEM certificate to trust for an
    https:// server whose certificate no public CA signed).
    """

    def __init__(
        self,
        server: Optional[str] = None,
        *,
        token_file: Optional[Union[str, Path]] = None,
        tls_ca: Optional[Union[str, Path]] = None,
        timeout: float = 60.0,
    ):
        server = server or os.environ.get("TRELLIS_SERVER") or DEFAULT_SERVER
        token_file = token_file or os.environ.get("TRELLIS_TOKEN_FILE")
        tls_ca = tls_ca or os.environ.get("TRELLIS_TLS_CA")
        target, tls = _target(server)
        self.server = server
        self.timeout = timeout
        self._metadata: Tuple[Tuple[str, str], ...] = ()
        if token_file:
            token = Path(token_file).read_text().strip()
            if not token:
                raise ValueError(f"{token_file}: the token file is empty")
            self._metadata = (("authorization", f"Bearer {token}"),)
        if tls:
            roots = Path(tls_ca).read_bytes() if tls_ca else None
            self._channel = grpc.secure_channel(
                target, grpc.ssl_channel_credentials(root_certificates=roots)
            )
        else:
            if tls_ca:
                raise ValueError(f"tls_ca is for https:// servers, not `{server}`")
            self._channel = grpc.insecure_channel(target)
        self._stub = job_pb2_grpc.JobServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method, request, timeout: Optional[float] = -1.0):
        try:
            return method(
                request,
                metadata=self._metadata,
                timeout=self.timeout if timeout == -1.0 else timeout,
            )
        except grpc.RpcError as e:
            raise _error(e) from None

    def submit(
        self,
        workflow: Union[str, Path],
        overrides: Sequence[str] = (),
        *,
        base_dir: Optional[Union[str, Path]] = None,
    ) -> Job:
        """Submits a workflow: a file path (`Path`, or a `str` naming an existing `.yaml`/`.yml`
        file) or its YAML text. `overrides` are `dotted.key=value` as `trellis train -o`.
        Relative paths in the workflow resolve against `base_dir` on the server (default: the
        file's folder, which is right when client and server share a file system). A workflow
        the server refuses raises `TrellisError` with code `INVALID_ARGUMENT` and the message
        naming the file, field and line."""
        path = None
        if isinstance(workflow, Path) or (
            isinstance(workflow, str) and "\n" not in workflow and workflow.endswith((".yaml", ".yml"))
        ):
            path = Path(workflow).resolve()
            text = path.read_text()
        else:
            text = workflow
        reply = self._call(
            self._stub.SubmitJob,
            job_pb2.SubmitJobRequest(
                workflow_yaml=text,
                overrides=list(overrides),
                file_name=path.name if path else "workflow.yaml",
                base_dir=str(base_dir or (path.parent if path else "")),
            ),
        )
        return Job._from_pb(reply.job)

    def job(self, job_id: int) -> Job:
        """The job as it is now."""
        return Job._from_pb(self._call(self._stub.GetJob, job_pb2.GetJobRequest(job_id=job_id)))

    def jobs(self) -> List[Job]:
        """Every job the server knows, oldest first."""
        reply = self._call(self._stub.ListJobs, job_pb2.ListJobsRequest())
        return [Job._from_pb(j) for j in reply.jobs]

    def cancel(self, job_id: int) -> Job:
        """Asks the job to stop after its current step (it can be resumed)."""
        return Job._from_pb(
            self._call(self._stub.CancelJob, job_pb2.CancelJobRequest(job_id=job_id))
        )

    def resume(self, job_id: int) -> Job:
        """Queues a failed or cancelled job again, from its last checkpoint."""
        return Job._from_pb(
            self._call(self._stub.ResumeJob, job_pb2.ResumeJobRequest(job_id=job_id))
        )

    def metrics(self, job_id: int, from_row: int = 0) -> List[MetricRow]:
        """The job's metric rows from `from_row` on."""
        reply = self._call(
            self._stub.GetMetrics, job_pb2.GetMetricsRequest(job_id=job_id, from_row=from_row)
        )
        return [_row(r) for r in reply.rows]

    def watch(self, job_id: int, from_row: int = 0, from_line: int = 0) -> Iterator[Event]:
        """Streams the job's events until it ends (the last event is the ended `Job`)."""
        stream = self._stub.WatchJob(
            job_pb2.WatchJobRequest(job_id=job_id, from_row=from_row, from_line=from_line),
            metadata=self._metadata,
        )
        try:
            for ev in stream:
                kind = ev.WhichOneof("event")
                if kind == "job":
                    yield Job._from_pb(ev.job)
                elif kind == "metrics":
                    yield _row(ev.metrics)
                elif kind == "log":
                    yield LogLine(ev.log.line, _time(ev.log.time_ms), ev.log.text)
        except grpc.RpcError as e:
            raise _error(e) from None
        finally:
            stream.cancel()

    def wait(self, job_id: int) -> Job:
        """Blocks until the job ends; returns it."""
        last = None
        for ev in self.watch(job_id):
            if isinstance(ev, Job):
                last = ev
        if last is None or not last.state.ended:
            # The stream ended without an ended job (the server went away): ask once more.
            last = self.job(job_id)
        return last


def _row(r) -> MetricRow:
    return MetricRow(row=r.row, stage=r.stage, step=r.step, values=dict(r.values))
