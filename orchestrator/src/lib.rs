//! The orchestrator: turns a workflow into work on actor pools and keeps the record of it.
//!
//! Owns (as it grows): workflow YAML → DAG, the per-algorithm RL step graph, the executor, the
//! job manager and its durable store, the gRPC job API server, the `trellis` CLI, metrics and
//! plots, the rollout pool and its router, and `trellis engine serve` (the native engine behind
//! vLLM's HTTP routes, `engine_server`).
//!
//! Never: touches tensor contents in job control (tensors move through the actors' data plane
//! and the weight folders), or speaks an external engine's API itself (the `rollout` adapters
//! do).

pub mod chat;
pub mod client;
pub mod doctor;
pub mod engine_bench;
pub mod engine_server;
pub mod graph;
pub mod plot;
pub mod pool;
mod rl;
pub mod server;
pub mod store;
pub mod tensorboard;
pub mod train;
pub mod workflow;
