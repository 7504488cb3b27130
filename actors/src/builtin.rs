//! Actor kinds every agent hosts: `ping`, for health checks, benchmarks and transport tests.
//!
//! Owns: diagnostic actors only. The engines' actor kinds live with the engines' users
//! (rollout and learner actors are registered by the binary).

use crate::actor::Actor;
use crate::error::CallError;
use crate::registry::Registry;
use crate::snapshot::content_crc;
use kernels::tensor::WeightSnapshot;
use serde::{Deserialize, Serialize};

/// Answers at once, holds the last weights it was given, and can be told to fail or die.
#[derive(Default)]
pub struct Ping {
    weights: Option<WeightSnapshot>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PingRequest {
    /// Returns the text.
    Echo(String),
    /// Describes the weights held.
    Weights,
    /// Fails this call with the message (the actor lives on).
    Fail(String),
    /// Fails this call as one that may succeed later (the actor lives on).
    Unavailable(String),
    /// Panics with the message (the actor dies: for restart drills).
    Panic(String),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PingResponse {
    Echo(String),
    Weights {
        version: Option<u64>,
        tensors: usize,
        bytes: u64,
        /// CRC-32C of every tensor's bytes in order (`snapshot::content_crc`).
        crc32c: u32,
    },
}

impl Actor for Ping {
    const KIND: &'static str = "ping";
    type Config = ();
    type Request = PingRequest;
    type Response = PingResponse;

    fn start((): ()) -> Result<Self, String> {
        Ok(Ping::default())
    }

    async fn handle(&mut self, request: PingRequest) -> Result<PingResponse, CallError> {
        match request {
            PingRequest::Echo(text) => Ok(PingResponse::Echo(text)),
            PingRequest::Weights => Ok(match &self.weights {
                Some(w) => {
                    let params = w.params().map_err(|e| CallError::fatal(e.to_string()))?;
                    PingResponse::Weights {
                        version: Some(w.version),
                        tensors: params.tensors.len(),
                        bytes: params.numel() as u64 * 4,
                        crc32c: content_crc(params),
                    }
                }
                None => PingResponse::Weights {
                    version: None,
                    tensors: 0,
                    bytes: 0,
                    crc32c: 0,
                },
            }),
            PingRequest::Fail(message) => Err(message.into()),
            PingRequest::Unavailable(message) => Err(CallError::retryable(message)),
            PingRequest::Panic(message) => panic!("{message}"),
        }
    }

    async fn load_weights(&mut self, snapshot: WeightSnapshot) -> Result<(), String> {
        self.weights = Some(snapshot);
        Ok(())
    }
}

/// The kinds every agent hosts.
pub fn registry() -> Registry {
    Registry::new().with::<Ping>()
}
