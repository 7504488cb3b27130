//! The errors of the actor runtime. Every variant names the actor, agent or pool involved.

use crate::placement::PlacementError;

/// What can go wrong calling, spawning, placing or feeding an actor.
#[derive(Clone, Debug, thiserror::Error)]
pub enum ActorError {
    /// The actor's handler returned an error; the actor lives on. `retryable`: the handler
    /// said the same call may succeed later (its engine did not answer).
    #[error("actor `{actor}` failed: {message}")]
    Failed {
        actor: String,
        message: String,
        retryable: bool,
    },
    /// The actor panicked, its agent was lost, or it was stopped while a call was in flight.
    #[error("actor `{actor}` died: {reason}")]
    Died { actor: String, reason: String },
    /// Restarts ran out: the actor stays down and every later call fails with this.
    #[error(
        "actor `{actor}` died {deaths} times within {window:.0?} and its restart policy allows {max_restarts} restarts in that time; last failure: {reason}"
    )]
    Exhausted {
        actor: String,
        deaths: u32,
        max_restarts: u32,
        window: std::time::Duration,
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

impl ActorError {
    /// Whether the same call may succeed when made again: the actor died or its agent was lost
    /// (it is restarted), or its handler said so. Everything else fails the same way again.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Died { .. } | Self::Agent { .. } => true,
            Self::Failed { retryable, .. } => *retryable,
            _ => false,
        }
    }
}

/// Why an actor's handler failed a call, and whether the same call may succeed later.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct CallError {
    /// What went wrong.
    pub message: String,
    /// The call may succeed if made again (a resource that did not answer), as opposed to a
    /// request that fails the same way every time.
    pub retryable: bool,
}

impl CallError {
    /// A failure the same call would meet again.
    pub fn fatal(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            retryable: false,
        }
    }

    /// A failure that may pass.
    pub fn retryable(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            retryable: true,
        }
    }
}

impl From<String> for CallError {
    fn from(message: String) -> Self {
        Self::fatal(message)
    }
}

impl From<&str> for CallError {
    fn from(message: &str) -> Self {
        Self::fatal(message)
    }
}
