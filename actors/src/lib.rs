//! The actor runtime: Trellis's replacement for Ray.
//!
//! Actors ([`Actor`]) run as tokio tasks in this process or inside node agents (`trellis agent`)
//! on other machines; callers hold the same [`ActorRef`] either way. The [`Head`] registers
//! agents, watches their heartbeats, places actors on them ([`placement`]) and restarts actors
//! that died by their [`RestartPolicy`], running a hook (to re-push weights) before a restarted
//! actor takes calls. Weight snapshots move in checksummed buckets: by `Arc` in-process, through
//! shared memory to agents on the same host, by gRPC streaming across hosts ([`snapshot`]).
//! The ranks of a group exchange values among themselves for their collectives — shared memory
//! on a host, TCP streams across ([`exchange`]).
//! Every head ↔ agent call carries the cluster token ([`Token`]).
//!
//! Never: interprets what an actor computes; it moves messages and bytes and watches liveness.

mod actor;
pub mod agent;
mod auth;
pub mod bench;
pub mod builtin;
mod error;
pub mod exchange;
pub mod head;
pub mod placement;
mod registry;
mod remote;
pub mod snapshot;

pub use actor::{
    Actor, ActorRef, BoxFuture, RestartHook, RestartPolicy, SpawnOptions, spawn_local,
};
pub use agent::{AgentError, AgentOptions};
pub use auth::{Bearer, Guard, Token, TokenError, presented};
pub use error::{ActorError, CallError};
pub use head::lend::{AgentRoom, Lender, Lent, Loan};
pub use head::{AgentInfo, Head, HeadConfig};
pub use placement::{Demand, Device, PoolSpec, Resources, Strategy};
pub use registry::Registry;
pub use remote::Wire;

/// Locks a mutex, taking the data even if a panicking thread poisoned it: every critical section
/// here leaves its map consistent, so a panic elsewhere never makes the runtime unusable.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
