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

/// How the policy is updated.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PolicyUpdate {
    /// The actor loss.
    pub loss: crate::rl::loss::PolicyLossConfig,
    /// How token losses add up over a mini-batch.
    pub agg: crate::rl::agg::LossAgg,
    /// The sampling temperature the log-probs are taken at.
    pub temperature: f32,
    /// Passes over the batch.
    pub epochs: usize,
    /// Rows per optimiser step.
    pub rows_per_update: usize,
}
