"""A Python client of Trellis's job API (`trellis serve`): submit workflows, watch jobs, cancel,
resume, read metrics.

    from trellis_client import Client
    with Client("http://127.0.0.1:7070") as c:
        job = c.submit("recipes/grpo-arith.yaml", ["stages.rl.trainer.steps=20"])
        for event in c.watch(job.id):
            print(event)

The command line is `trellis-client` (or `python -m trellis_client`).
"""

from ._client import (
    DEFAULT_SERVER,
    Client,
    Event,
    Job,
    JobState,
    LogLine,
    MetricRow,
    TrellisError,
)

__all__ = [
    "DEFAULT_SERVER",
    "Client",
    "Event",
    "Job",
    "JobState",
    "LogLine",
    "MetricRow",
    "TrellisError",
]
__version__ = "0.1.0"
