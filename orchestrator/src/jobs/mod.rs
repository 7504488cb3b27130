//! Jobs: the one lifecycle every job goes through ([`run`]: `trellis train` and `resume` in this
//! process, and each job of `trellis serve`), the server's [`queue`] of jobs, over the durable
//! [`crate::store`], and the [`worker`] protocol by which a server's job runs in a process of
//! its own.
//!
//! Owns: how a job starts, continues and ends, and the state each ending leaves it in. Never:
//! parses workflows (the plan does) or runs a step (the executor does).

pub mod queue;
pub mod run;
pub mod worker;

pub use run::{
    JobError, Outcome, RunOptions, Status, StopFlag, StopReason, request_stop, status,
    stop_requested,
};
