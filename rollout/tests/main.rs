//! The rollout crate's integration tests, one binary with a module per area: the native engine,
//! Parquet files written by pyarrow, and the `pjrt` engine on the XLA CPU plugin.

mod native;
mod parquet;
mod pjrt;
