//! The rollout crate's integration tests, one binary with a module per area: the native engine,
//! episodes on it,
//! Parquet files written by pyarrow, and the `pjrt` engine on the XLA CPU plugin.

#![allow(clippy::print_stdout, clippy::print_stderr)]

mod episode;
mod native;
mod parquet;
mod pjrt;
