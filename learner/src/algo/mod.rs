//! The learner's algorithms over a [`crate::engine::TrainEngine`]: how rows of prompts and
//! responses are laid out for the RL formulas ([`layout`]), the epochs × mini-batches policy
//! update ([`policy`]), the critic's value update ([`value`]) and the SFT step ([`sft`]), on one
//! engine or on data-parallel ranks ([`dp`]).
//! Everything here runs the same in the driver's process or inside an actor.
//!
//! Owns: the `[rows, cols]` layout of response tokens and its mapping to padded batches, the
//! update loops, and how their metrics are averaged. Never: samples, scores rewards or decides
//! which rows to train on (the orchestrator does), and never knows which engine it drives.

pub mod dp;
pub mod layout;
pub mod policy;
pub mod sft;
pub mod value;

pub use layout::TokenRows;
