//! The learner's integration tests, one binary with a module per area: chat prompts and parity with
//! `transformers` on the fixture, refused checkpoints, and the `pjrt` engine on the XLA CPU
//! plugin.

#![allow(clippy::print_stdout, clippy::print_stderr)]

mod bad_checkpoints;
mod chat;
mod parity;
mod pjrt;
