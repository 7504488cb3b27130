//! The orchestrator: turns a workflow into work on roles and actor pools, and keeps the record
//! of it.
//!
//! Layers, each using only those before it in this list: [`plan`] (a workflow parsed once into
//! types, checked before anything runs); [`store`] (the durable job store);
//! [`kinds`] and [`pools`] (actors that host engines, and the pools that place, supervise and
//! route to them); [`roles`] (what the executor may ask of the models, local or actor-backed);
//! [`record`] (the run's sinks); [`exec`] (runs a plan's stages against roles); [`jobs`] (the
//! one job lifecycle, the server's queue).
//!
//! Never: prints (a sink of the binary does), parses command lines or serves HTTP (the
//! `trellis` binary does), touches tensor contents in job control (weights move through the
//! actors' data plane and the weight folders; the learner pool's gradient sum, in slices over
//! actor calls, is the one exception until ranks reduce among themselves), or speaks an external
//! engine's API itself (the `rollout` adapters do).

pub mod exec;
pub mod jobs;
pub mod kinds;
pub mod plan;
pub mod pools;
pub mod record;
pub mod roles;
pub mod store;

/// The poison-tolerant lock: a panic elsewhere never wedges a pool or an actor.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
