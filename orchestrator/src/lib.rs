//! The orchestrator: turns a workflow into work on actor pools and keeps the record of it.
//!
//! Owns (as it grows): workflow YAML → DAG, the per-algorithm RL step graph, the executor, the
//! job manager and its durable store, the gRPC job API server, the `trellis` CLI, metrics and
//! plots.
//!
//! Never: touches tensor contents (tensors move through the actors' data plane, not through job
//! control), or opens engine-specific sockets (engines and their adapters own those).

pub mod chat;
pub mod client;
pub mod doctor;
pub mod graph;
pub mod plot;
pub mod pool;
mod rl;
pub mod server;
pub mod store;
pub mod tensorboard;
pub mod train;
pub mod workflow;
