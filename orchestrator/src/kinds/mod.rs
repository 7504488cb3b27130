//! Actor kinds: the adapters that host a role's engine inside an actor, in this process or on
//! an agent (`trellis agent` registers every kind here).
//!
//! Owns: each kind's start config, requests and responses. Never: routes calls between actors
//! or restarts them (the pools and the actor runtime do).

pub mod learner;
pub mod rollout;

/// Every actor kind an agent of this build can host.
pub fn registry() -> actors::Registry {
    actors::builtin::registry()
        .with::<rollout::RolloutActor>()
        .with::<learner::LearnerActor>()
}
