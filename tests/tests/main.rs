//! End-to-end tests of Trellis, one binary with a module per area (one link on a 2-core CI
//! instead of one per file, as ripgrep has): each drives the real `trellis` binary and real
//! processes (`trellis_tests::trellis()` finds or builds it).

#![allow(clippy::print_stdout, clippy::print_stderr)]

mod actors;
mod arith_recipe;
mod chaos;
mod cli;
mod deploy;
mod engines;
mod episodes;
mod generate;
mod netns;
mod pjrt;
mod score;
mod serve;
mod store;
mod tidy;
mod tracking;
mod train;
mod train_agents;
