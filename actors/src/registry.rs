//! The actor kinds an agent can host, by name, and the type-erased mailbox the agent calls them
//! through (JSON requests and responses, weight snapshots as values).
//!
//! Owns: kind lookup and the bytes ↔ typed-message boundary on the hosting side. Does not own:
//! supervision (the head restarts remote actors; an agent only reports deaths).

use crate::actor::{Actor, BoxFuture, Envelope, start_local};
use crate::error::ActorError;
use bytes::Bytes;
use kernels::tensor::WeightSnapshot;
use proto::v1::failure::Code;
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;

/// A failed call as the agent reports it.
pub(crate) type CallFailure = (Code, String);

/// The hosting side of one actor.
pub(crate) trait Mailbox: Send + Sync {
    fn call(&self, payload: Bytes) -> BoxFuture<'static, Result<Vec<u8>, CallFailure>>;
    fn load_weights(&self, snapshot: WeightSnapshot) -> BoxFuture<'static, Result<(), String>>;
}

struct Typed<A: Actor>(mpsc::Sender<Envelope<A>>);

impl<A: Actor> Mailbox for Typed<A> {
    fn call(&self, payload: Bytes) -> BoxFuture<'static, Result<Vec<u8>, CallFailure>> {
        let tx = self.0.clone();
        Box::pin(async move {
            let request: A::Request = A::decode_request(&payload).map_err(|e| {
                (
                    Code::BadMessage,
                    format!("not a `{}` request: {e}", A::KIND),
                )
            })?;
            let died = || {
                (
                    Code::Died,
                    "it stopped while the call was queued or running".to_string(),
                )
            };
            let (reply, answer) = oneshot::channel();
            tx.send(Envelope::Call(request, reply))
                .await
                .map_err(|_| died())?;
            match answer.await {
                Ok(Ok(response)) => A::encode_response(&response)
                    .map_err(|e| (Code::BadMessage, format!("response does not encode: {e}"))),
                Ok(Err(e)) => Err((
                    if e.retryable {
                        Code::Unavailable
                    } else {
                        Code::Failed
                    },
                    e.message,
                )),
                Err(_) => Err(died()),
            }
        })
    }

    fn load_weights(&self, snapshot: WeightSnapshot) -> BoxFuture<'static, Result<(), String>> {
        let tx = self.0.clone();
        Box::pin(async move {
            let (reply, answer) = oneshot::channel();
            tx.send(Envelope::Weights(snapshot, reply))
                .await
                .map_err(|_| "the actor stopped".to_string())?;
            answer
                .await
                .map_err(|_| "the actor died taking the weights".to_string())?
        })
    }
}

/// One actor hosted by an agent.
pub(crate) struct Hosted {
    pub mailbox: Arc<dyn Mailbox>,
    pub abort: AbortHandle,
    pub death: oneshot::Receiver<String>,
}

type Factory = Arc<
    dyn Fn(String, Bytes, usize) -> BoxFuture<'static, Result<Hosted, ActorError>> + Send + Sync,
>;

/// Actor kinds by name.
#[derive(Clone, Default)]
pub struct Registry {
    kinds: BTreeMap<&'static str, Factory>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.kinds.keys()).finish()
    }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Registry::default()
    }

    /// Adds kind `A` under `A::KIND`.
    pub fn with<A: Actor>(mut self) -> Self {
        let factory: Factory = Arc::new(|actor_id: String, config: Bytes, mailbox: usize| {
            Box::pin(async move {
                let config: A::Config =
                    serde_json::from_slice(&config).map_err(|e| ActorError::Start {
                        actor: actor_id.clone(),
                        kind: A::KIND.to_string(),
                        message: format!("bad config: {e}"),
                    })?;
                let local = start_local::<A>(&actor_id, config, mailbox).await?;
                Ok(Hosted {
                    mailbox: Arc::new(Typed::<A>(local.tx)),
                    abort: local.abort,
                    death: local.death,
                })
            })
        });
        self.kinds.insert(A::KIND, factory);
        self
    }

    /// The registered kinds' names, sorted.
    pub fn kinds(&self) -> Vec<String> {
        self.kinds.keys().map(|k| k.to_string()).collect()
    }

    /// Starts an actor of `kind` from its JSON config.
    pub(crate) async fn start(
        &self,
        kind: &str,
        actor_id: String,
        config: Bytes,
        mailbox: usize,
    ) -> Result<Hosted, ActorError> {
        let Some(factory) = self.kinds.get(kind) else {
            return Err(ActorError::Start {
                actor: actor_id,
                kind: kind.to_string(),
                message: format!(
                    "this agent has no such kind; it runs: {}",
                    self.kinds().join(", ")
                ),
            });
        };
        factory(actor_id, config, mailbox).await
    }
}
