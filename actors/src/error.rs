//! The errors of the actor runtime. Every variant names the actor, agent or pool involved.

use crate::placement::PlacementError;

/// What can go wrong calling, spawning, placing or feeding an actor.
#[derive(Clone, Debug, thiserror::Error)]
pub enum ActorError {
    /// The actor's handler returned an error; the actor lives on.
    #[error("actor `{actor}` failed: {message}")]
    Failed { actor: String, message: String },
    /// The actor panicked, its agent was lost, or it was stopped while a call was in flight.
    #[error("actor `{actor}` died: {reason}")]
    Died { actor: String, reason: String },
    /// Restarts ran out: the actor stays down and every later call fails with this.
    #[error(
        "actor `{actor}` died {deaths} times and its restart policy allows {max_restarts} restarts; last failure: {reason}"
    )]
    Exhausted {
        actor: String,
        deaths: u32,
        max_restarts: u32,
        reason: String,
    },
    /// The actor was stopped on purpose.
    #[error("actor `{actor}` was stopped")]
    Stopped { actor: String },
    /// A request or reply could not be encoded or decoded.
    #[error("actor `{actor}`: bad message: {message}")]
    BadMessage { actor: String, message: String },
    /// The actor could not be created from its configuration.
    #[error("could not start actor `{actor}` of kind `{kind}`: {message}")]
    Start {
        actor: String,
        kind: String,
        message: String,
    },
    /// An agent refused or failed a request, or could not be reached.
    #[error("agent `{agent}`: {message}")]
    Agent { agent: String, message: String },
    /// The actors asked for cannot be placed on the agents that are registered.
    #[error(transparent)]
    Placement(#[from] PlacementError),
    /// A weight snapshot was malformed or corrupted in transit.
    #[error("weight snapshot for `{actor}`: {message}")]
    Snapshot { actor: String, message: String },
}
