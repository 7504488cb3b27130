//! Actors, their handles, and supervision.
//!
//! An actor is a value that handles one message at a time from a bounded mailbox. Whether it
//! runs as a tokio task in this process or inside a node agent on another machine, callers hold
//! the same [`ActorRef`]; a supervisor task watches each actor, restarts it by its
//! [`RestartPolicy`] when it dies, runs the restart hook (to re-push weights, say) before the new
//! incarnation takes calls, and turns the handle into a clear error when restarts run out.
//!
//! Owns: the `Actor` trait, mailboxes, handles, the supervisor loop. Does not own: where a remote
//! actor runs (the head decides) or how bytes cross the network (`remote`).

use crate::error::{ActorError, CallError};
use crate::remote::RemoteActor;
use kernels::tensor::WeightSnapshot;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::AbortHandle;

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A kind of actor: started from a serialisable config, it answers typed requests one at a time.
///
/// Handlers must not block the async runtime for long: heavy compute belongs on a worker thread
/// of the actor's own (as the native engine does) or in `tokio::task::spawn_blocking`.
pub trait Actor: Send + Sized + 'static {
    /// The name agents register this kind under (`trellis agent` announces its kinds).
    const KIND: &'static str;
    /// How to start one, sent to the agent that hosts it.
    type Config: Serialize + DeserializeOwned + Clone + Send + Sync + 'static;
    type Request: Serialize + DeserializeOwned + Send + 'static;
    type Response: Serialize + DeserializeOwned + Send + 'static;

    /// Builds the actor (runs on a blocking thread: it may load a model).
    fn start(config: Self::Config) -> Result<Self, String>;

    /// Answers one request. An `Err` fails this call only (saying whether the same call may
    /// succeed later); a panic kills the actor.
    fn handle(
        &mut self,
        request: Self::Request,
    ) -> impl Future<Output = Result<Self::Response, CallError>> + Send;

    /// A request as bytes for an actor in another process: JSON, unless the kind frames bulk
    /// numbers raw (as the learner kind does its gradient slices).
    fn encode_request(request: &Self::Request) -> Result<Vec<u8>, String> {
        serde_json::to_vec(request).map_err(|e| e.to_string())
    }

    /// Back from [`Actor::encode_request`]'s bytes.
    fn decode_request(bytes: &[u8]) -> Result<Self::Request, String> {
        serde_json::from_slice(bytes).map_err(|e| e.to_string())
    }

    /// A response as bytes, as [`Actor::encode_request`].
    fn encode_response(response: &Self::Response) -> Result<Vec<u8>, String> {
        serde_json::to_vec(response).map_err(|e| e.to_string())
    }

    /// Back from [`Actor::encode_response`]'s bytes.
    fn decode_response(bytes: &[u8]) -> Result<Self::Response, String> {
        serde_json::from_slice(bytes).map_err(|e| e.to_string())
    }

    /// Takes a new weight snapshot (rollout actors swap their engine's weights here).
    fn load_weights(
        &mut self,
        snapshot: WeightSnapshot,
    ) -> impl Future<Output = Result<(), String>> + Send {
        let _ = snapshot;
        async { Err(format!("actors of kind `{}` take no weights", Self::KIND)) }
    }
}

/// A message in a local actor's mailbox.
pub(crate) enum Envelope<A: Actor> {
    Call(A::Request, oneshot::Sender<Result<A::Response, CallError>>),
    Weights(WeightSnapshot, oneshot::Sender<Result<(), String>>),
}

/// A running local actor: its mailbox, a way to kill it, and a receiver of why it ended.
pub(crate) struct Local<A: Actor> {
    pub tx: mpsc::Sender<Envelope<A>>,
    pub abort: AbortHandle,
    pub death: oneshot::Receiver<String>,
}

/// Starts `A` as a tokio task with a mailbox of `mailbox` messages.
pub(crate) async fn start_local<A: Actor>(
    name: &str,
    config: A::Config,
    mailbox: usize,
) -> Result<Local<A>, ActorError> {
    let start_error = |message: String| ActorError::Start {
        actor: name.to_string(),
        kind: A::KIND.to_string(),
        message,
    };
    let mut actor = match tokio::task::spawn_blocking(move || A::start(config)).await {
        Ok(Ok(actor)) => actor,
        Ok(Err(message)) => return Err(start_error(message)),
        Err(e) => return Err(start_error(join_error_message(e))),
    };
    let (tx, mut rx) = mpsc::channel::<Envelope<A>>(mailbox.max(1));
    let task = tokio::spawn(async move {
        while let Some(envelope) = rx.recv().await {
            match envelope {
                Envelope::Call(request, reply) => {
                    let result = actor.handle(request).await;
                    let _ = reply.send(result);
                }
                Envelope::Weights(snapshot, reply) => {
                    let result = actor.load_weights(snapshot).await;
                    let _ = reply.send(result);
                }
            }
        }
    });
    let abort = task.abort_handle();
    let (death_tx, death) = oneshot::channel();
    tokio::spawn(async move {
        let reason = match task.await {
            Ok(()) => "its mailbox closed".to_string(),
            Err(e) => join_error_message(e),
        };
        let _ = death_tx.send(reason);
    });
    Ok(Local { tx, abort, death })
}

fn join_error_message(e: tokio::task::JoinError) -> String {
    if e.is_cancelled() {
        return "stopped".to_string();
    }
    let payload = e.into_panic();
    let message = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with a non-string payload".to_string());
    format!("panicked: {message}")
}

pub(crate) async fn local_call<A: Actor>(
    name: &str,
    tx: &mpsc::Sender<Envelope<A>>,
    request: A::Request,
) -> Result<A::Response, ActorError> {
    let died = || ActorError::Died {
        actor: name.to_string(),
        reason: "it stopped while the call was queued or running".to_string(),
    };
    let (reply, answer) = oneshot::channel();
    tx.send(Envelope::Call(request, reply))
        .await
        .map_err(|_| died())?;
    match answer.await {
        Ok(Ok(response)) => Ok(response),
        Ok(Err(e)) => Err(ActorError::Failed {
            actor: name.to_string(),
            message: e.message,
            retryable: e.retryable,
        }),
        Err(_) => Err(died()),
    }
}

/// Where calls to an actor go right now.
pub(crate) enum Link<A: Actor> {
    Local(mpsc::Sender<Envelope<A>>, AbortHandle),
    Remote(RemoteActor),
    /// Its previous incarnation died and the next one is starting: calls wait.
    Restarting,
    /// It is down for good: calls fail with this.
    Down(ActorError),
}

impl<A: Actor> Clone for Link<A> {
    fn clone(&self) -> Self {
        match self {
            Link::Local(tx, abort) => Link::Local(tx.clone(), abort.clone()),
            Link::Remote(r) => Link::Remote(r.clone()),
            Link::Restarting => Link::Restarting,
            Link::Down(e) => Link::Down(e.clone()),
        }
    }
}

impl<A: Actor> Link<A> {
    /// Ends this incarnation (kills the task, or asks its agent to stop it).
    pub(crate) async fn stop(&self) {
        match self {
            Link::Local(_, abort) => abort.abort(),
            Link::Remote(r) => r.stop().await,
            Link::Restarting | Link::Down(_) => {}
        }
    }
}

/// The host of a URL (`https://[::1]:7071/x` → `::1`).
fn url_host(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    let host = match authority.rsplit_once(':') {
        Some((h, port)) if !h.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => authority,
    };
    host.trim_start_matches('[').trim_end_matches(']')
}

/// A handle to an actor, local or remote; cheap to clone. When every handle is dropped the actor
/// is stopped.
pub struct ActorRef<A: Actor> {
    name: Arc<str>,
    link: watch::Receiver<Link<A>>,
    control: Arc<watch::Sender<bool>>,
}

impl<A: Actor> Clone for ActorRef<A> {
    fn clone(&self) -> Self {
        ActorRef {
            name: self.name.clone(),
            link: self.link.clone(),
            control: self.control.clone(),
        }
    }
}

impl<A: Actor> std::fmt::Debug for ActorRef<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActorRef")
            .field("name", &self.name)
            .field("kind", &A::KIND)
            .finish()
    }
}

impl<A: Actor> ActorRef<A> {
    /// The actor's name (stable across restarts).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where it runs now: `local`, the agent's name, `restarting` or `down`.
    pub fn location(&self) -> String {
        match &*self.link.borrow() {
            Link::Local(..) => "local".to_string(),
            Link::Remote(r) => r.agent_name().to_string(),
            Link::Restarting => "restarting".to_string(),
            Link::Down(_) => "down".to_string(),
        }
    }

    /// The host its agent is reached at (from the agent's advertised URL); `None` in this
    /// process, or while it has no incarnation.
    pub fn agent_host(&self) -> Option<String> {
        match &*self.link.borrow() {
            Link::Remote(r) => Some(url_host(r.agent_address()).to_string()),
            _ => None,
        }
    }

    /// Sends one request and waits for its answer. A call made while the actor restarts waits
    /// for the new incarnation; a call in flight when it dies fails with [`ActorError::Died`].
    pub async fn call(&self, request: A::Request) -> Result<A::Response, ActorError> {
        let mut link = self.link.clone();
        loop {
            let current = link.borrow_and_update().clone();
            match current {
                Link::Local(tx, _) => return local_call::<A>(&self.name, &tx, request).await,
                Link::Remote(remote) => {
                    let bad = |message: String| ActorError::BadMessage {
                        actor: self.name.to_string(),
                        message,
                    };
                    let payload = A::encode_request(&request).map_err(bad)?;
                    let reply = remote.call(&self.name, payload).await?;
                    return A::decode_response(&reply)
                        .map_err(|e| bad(format!("reply does not decode: {e}")));
                }
                Link::Restarting => self.wait_for_change(&mut link).await?,
                Link::Down(e) => return Err(e),
            }
        }
    }

    /// Hands the actor a weight snapshot: in-process by `Arc` (no copy), to an agent on this
    /// host through shared memory, to other hosts by gRPC streaming. Returns once the actor has
    /// taken it.
    pub async fn load_weights(&self, snapshot: WeightSnapshot) -> Result<(), ActorError> {
        self.load_weights_as(snapshot, None).await
    }

    /// [`ActorRef::load_weights`], the tensors `bf16` marks sent as bf16 where they are
    /// streamed (to other hosts: half their bytes; the receiver widens them back to f32) — for
    /// an actor that reads them only rounded to bf16. In-process and shared-memory hand-overs
    /// stay f32: they copy nothing or once.
    pub async fn load_weights_as(
        &self,
        snapshot: WeightSnapshot,
        bf16: Option<&[bool]>,
    ) -> Result<(), ActorError> {
        let mut link = self.link.clone();
        loop {
            let current = link.borrow_and_update().clone();
            match current {
                Link::Local(tx, _) => {
                    let died = || ActorError::Died {
                        actor: self.name.to_string(),
                        reason: "it stopped while taking weights".to_string(),
                    };
                    let (reply, answer) = oneshot::channel();
                    tx.send(Envelope::Weights(snapshot, reply))
                        .await
                        .map_err(|_| died())?;
                    return match answer.await {
                        Ok(Ok(())) => Ok(()),
                        Ok(Err(message)) => Err(ActorError::Failed {
                            actor: self.name.to_string(),
                            message,
                            retryable: false,
                        }),
                        Err(_) => Err(died()),
                    };
                }
                Link::Remote(remote) => {
                    return remote.load_weights(&self.name, &snapshot, bf16).await;
                }
                Link::Restarting => self.wait_for_change(&mut link).await?,
                Link::Down(e) => return Err(e),
            }
        }
    }

    /// Stops the actor (every handle then fails calls with [`ActorError::Stopped`]).
    pub fn stop(&self) {
        self.control.send_replace(true);
    }

    /// Stops the actor and waits until it is down (a remote one's agent was told to stop it).
    pub async fn stop_and_wait(&self) {
        self.stop();
        let mut link = self.link.clone();
        while !matches!(*link.borrow_and_update(), Link::Down(_)) {
            if link.changed().await.is_err() {
                return;
            }
        }
    }

    /// Waits until the actor is up (not restarting) or down for good.
    pub async fn ready(&self) -> Result<(), ActorError> {
        let mut link = self.link.clone();
        loop {
            let current = link.borrow_and_update().clone();
            match current {
                Link::Restarting => self.wait_for_change(&mut link).await?,
                Link::Down(e) => return Err(e),
                Link::Local(..) | Link::Remote(_) => return Ok(()),
            }
        }
    }

    async fn wait_for_change(&self, link: &mut watch::Receiver<Link<A>>) -> Result<(), ActorError> {
        link.changed().await.map_err(|_| ActorError::Died {
            actor: self.name.to_string(),
            reason: "its supervisor ended".to_string(),
        })
    }

    /// A handle pinned to one incarnation, for restart hooks (the supervisor's own handle still
    /// says `Restarting` while the hook runs).
    fn pinned(name: Arc<str>, link: Link<A>) -> Self {
        let (_tx, rx) = watch::channel(link);
        ActorRef {
            name,
            link: rx,
            control: Arc::new(watch::channel(false).0),
        }
    }
}

/// How often, and how soon, a dead actor is started again: a budget of deaths per time window
/// (as Kubernetes' crash-loop backoff: a long job on machines that come and go does not die of
/// its fourth agent loss over days), and how long a restart on agents waits for one with room.
#[derive(Clone, Debug, PartialEq)]
pub struct RestartPolicy {
    /// Restarts allowed within `window`; 0 means a death is final.
    pub max_restarts: u32,
    /// Deaths older than this no longer count (nor lengthen the backoff).
    pub window: Duration,
    /// Wait before the first restart in a window; doubles with each further one.
    pub backoff: Duration,
    /// Longest wait between restarts.
    pub max_backoff: Duration,
    /// How long a restart on agents waits for an agent with room (one coming back, one joining)
    /// before it counts as a failed start.
    pub place_wait: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            max_restarts: 3,
            window: Duration::from_secs(600),
            backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            place_wait: Duration::from_secs(120),
        }
    }
}

impl RestartPolicy {
    /// The wait before restart number `n` (1-based).
    pub fn delay(&self, n: u32) -> Duration {
        let factor = 1u32 << n.saturating_sub(1).min(16);
        self.backoff.saturating_mul(factor).min(self.max_backoff)
    }
}

/// Runs after a restarted actor starts and before it takes calls: the orchestrator re-pushes the
/// current weights to a restarted rollout actor here. An error counts as another death.
pub type RestartHook<A> =
    Arc<dyn Fn(ActorRef<A>) -> BoxFuture<'static, Result<(), ActorError>> + Send + Sync>;

/// How an actor is started, watched and restarted.
pub struct SpawnOptions<A: Actor> {
    /// Mailbox capacity: calls beyond it wait to be queued.
    pub mailbox: usize,
    pub restart: RestartPolicy,
    pub on_restart: Option<RestartHook<A>>,
}

impl<A: Actor> Default for SpawnOptions<A> {
    fn default() -> Self {
        SpawnOptions {
            mailbox: 256,
            restart: RestartPolicy::default(),
            on_restart: None,
        }
    }
}

impl<A: Actor> Clone for SpawnOptions<A> {
    fn clone(&self) -> Self {
        SpawnOptions {
            mailbox: self.mailbox,
            restart: self.restart.clone(),
            on_restart: self.on_restart.clone(),
        }
    }
}

/// One started incarnation: where calls go and a receiver of the reason it ends.
pub(crate) struct Incarnation<A: Actor> {
    pub link: Link<A>,
    pub death: oneshot::Receiver<String>,
}

/// Starts incarnation number `n` (0 first); restarts pass the same closure larger `n`. It gives
/// up waiting (for room, say) once `stopping` says the actor was stopped ([`stop_requested`]).
pub(crate) type Starter<A> = Arc<
    dyn Fn(u32, watch::Receiver<bool>) -> BoxFuture<'static, Result<Incarnation<A>, ActorError>>
        + Send
        + Sync,
>;

/// Starts the first incarnation with `starter` and supervises it; fails if it cannot start.
pub(crate) async fn supervise<A: Actor>(
    name: &str,
    starter: Starter<A>,
    options: SpawnOptions<A>,
) -> Result<ActorRef<A>, ActorError> {
    let (control_tx, control_rx) = watch::channel(false);
    let first = starter(0, control_rx.clone()).await?;
    let name: Arc<str> = Arc::from(name);
    let (link_tx, link_rx) = watch::channel(first.link);
    tokio::spawn(supervisor_loop(
        name.clone(),
        link_tx,
        first.death,
        control_rx,
        starter,
        options,
    ));
    Ok(ActorRef {
        name,
        link: link_rx,
        control: Arc::new(control_tx),
    })
}

async fn supervisor_loop<A: Actor>(
    name: Arc<str>,
    link_tx: watch::Sender<Link<A>>,
    mut death: oneshot::Receiver<String>,
    mut control: watch::Receiver<bool>,
    starter: Starter<A>,
    options: SpawnOptions<A>,
) {
    // When each death that still counts happened (within the policy's window).
    let mut recent: std::collections::VecDeque<tokio::time::Instant> = Default::default();
    let mut incarnation = 0u32;
    loop {
        let reason = tokio::select! {
            reason = &mut death => reason.unwrap_or_else(|_| "its watcher ended".to_string()),
            // `true` (stop) or every handle dropped (Err): stop this incarnation and end.
            _ = wait_for_stop(&mut control) => {
                let current = link_tx.borrow().clone();
                current.stop().await;
                link_tx.send_replace(Link::Down(ActorError::Stopped { actor: name.to_string() }));
                return;
            }
        };
        let now = tokio::time::Instant::now();
        recent.push_back(now);
        while recent
            .front()
            .is_some_and(|&t| now.duration_since(t) > options.restart.window)
        {
            recent.pop_front();
        }
        let deaths = recent.len() as u32;
        let max = options.restart.max_restarts;
        if deaths > max {
            tracing::error!(actor = %name, %reason, deaths, "actor died; no restarts left");
            link_tx.send_replace(Link::Down(ActorError::Exhausted {
                actor: name.to_string(),
                deaths,
                max_restarts: max,
                window: options.restart.window,
                reason,
            }));
            return;
        }
        tracing::warn!(actor = %name, %reason, restart = deaths, max, "actor died; restarting");
        link_tx.send_replace(Link::Restarting);
        // Stopped while it restarted (a restart may wait minutes for room): nothing restarts
        // it, and whatever came up goes down again.
        let stopped = || {
            Link::Down(ActorError::Stopped {
                actor: name.to_string(),
            })
        };
        tokio::select! {
            _ = tokio::time::sleep(options.restart.delay(deaths)) => {}
            _ = wait_for_stop(&mut control) => {
                link_tx.send_replace(stopped());
                return;
            }
        }
        incarnation += 1;
        let started = starter(incarnation, control.clone()).await;
        if stop_requested(&control) {
            if let Ok(next) = started {
                next.link.stop().await;
            }
            link_tx.send_replace(stopped());
            return;
        }
        match started {
            Ok(next) => {
                if let Some(hook) = &options.on_restart {
                    let pinned = ActorRef::pinned(name.clone(), next.link.clone());
                    if let Err(e) = hook(pinned).await {
                        next.link.stop().await;
                        death = settled(format!("its restart hook failed: {e}"));
                        continue;
                    }
                }
                tracing::info!(actor = %name, restart = incarnation, "actor restarted");
                link_tx.send_replace(next.link);
                death = next.death;
            }
            Err(e) => death = settled(format!("restart failed: {e}")),
        }
    }
}

/// Whether the actor was stopped: asked to, or every handle dropped.
pub(crate) fn stop_requested(control: &watch::Receiver<bool>) -> bool {
    *control.borrow() || control.has_changed().is_err()
}

/// Returns once the actor was stopped ([`stop_requested`]).
pub(crate) async fn wait_for_stop(control: &mut watch::Receiver<bool>) {
    loop {
        if *control.borrow_and_update() {
            return;
        }
        if control.changed().await.is_err() {
            return;
        }
    }
}

fn settled(reason: String) -> oneshot::Receiver<String> {
    let (tx, rx) = oneshot::channel();
    let _ = tx.send(reason);
    rx
}

/// Spawns `A` as a supervised tokio task in this process.
pub async fn spawn_local<A: Actor>(
    name: &str,
    config: A::Config,
    options: SpawnOptions<A>,
) -> Result<ActorRef<A>, ActorError> {
    let mailbox = options.mailbox;
    let actor_name = name.to_string();
    let starter: Starter<A> = Arc::new(move |_n, _stopping| {
        let config = config.clone();
        let actor_name = actor_name.clone();
        Box::pin(async move {
            let local = start_local::<A>(&actor_name, config, mailbox).await?;
            Ok(Incarnation {
                link: Link::Local(local.tx, local.abort),
                death: local.death,
            })
        })
    });
    supervise(name, starter, options).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agents_host_is_its_urls() {
        for (url, host) in [
            ("http://10.0.0.5:7071", "10.0.0.5"),
            ("https://node-3.cluster:443/", "node-3.cluster"),
            ("http://[fd00::1]:7071", "fd00::1"),
            ("http://[::1]", "::1"),
            ("localhost:80", "localhost"),
            ("http://host", "host"),
        ] {
            assert_eq!(url_host(url), host, "{url}");
        }
    }
    use crate::builtin::{Ping, PingRequest, PingResponse};
    use std::sync::atomic::{AtomicU32, Ordering};

    fn fast(max_restarts: u32) -> RestartPolicy {
        RestartPolicy {
            max_restarts,
            backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(10),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_local_actor_answers_fails_dies_restarts_and_runs_its_hook() {
        let hooks = Arc::new(AtomicU32::new(0));
        let counter = hooks.clone();
        let hook: RestartHook<Ping> = Arc::new(move |actor| {
            let counter = counter.clone();
            Box::pin(async move {
                // The hook reaches the new incarnation before anyone else does.
                actor.call(PingRequest::Echo("hook".into())).await?;
                counter.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
        });
        let options = SpawnOptions {
            restart: fast(1),
            on_restart: Some(hook),
            ..SpawnOptions::default()
        };
        let ping = spawn_local::<Ping>("ping", (), options)
            .await
            .expect("starts");
        assert_eq!(ping.location(), "local");
        let r = ping
            .call(PingRequest::Echo("hi".into()))
            .await
            .expect("answers");
        assert_eq!(r, PingResponse::Echo("hi".into()));
        let e = ping
            .call(PingRequest::Fail("nope".into()))
            .await
            .unwrap_err();
        assert_eq!(e.to_string(), "actor `ping` failed: nope");
        assert!(
            !e.is_retryable(),
            "a handler's error is final unless it says so"
        );
        let e = ping
            .call(PingRequest::Unavailable("busy".into()))
            .await
            .unwrap_err();
        assert!(e.is_retryable(), "{e:?}");

        let e = ping
            .call(PingRequest::Panic("boom".into()))
            .await
            .unwrap_err();
        assert!(matches!(e, ActorError::Died { .. }), "{e}");
        // The next call waits for the restart, and the hook ran first.
        let r = ping
            .call(PingRequest::Echo("again".into()))
            .await
            .expect("restarted");
        assert_eq!(r, PingResponse::Echo("again".into()));
        assert_eq!(hooks.load(Ordering::SeqCst), 1);

        let _ = ping.call(PingRequest::Panic("boom twice".into())).await;
        let e = ping.call(PingRequest::Echo("x".into())).await.unwrap_err();
        assert_eq!(
            e.to_string(),
            "actor `ping` died 2 times within 600s and its restart policy allows 1 restarts in that time; last failure: panicked: boom twice"
        );
    }

    #[tokio::test]
    async fn deaths_older_than_the_window_no_longer_count() {
        let options = SpawnOptions {
            restart: RestartPolicy {
                window: Duration::from_millis(600),
                ..fast(1)
            },
            ..SpawnOptions::default()
        };
        let ping = spawn_local::<Ping>("ping", (), options)
            .await
            .expect("starts");
        // Three deaths, each after the one before has left the window: never exhausted.
        for i in 0..3 {
            let _ = ping.call(PingRequest::Panic(format!("death {i}"))).await;
            let r = ping.call(PingRequest::Echo("up".into())).await;
            assert_eq!(
                r.expect("restarted"),
                PingResponse::Echo("up".into()),
                "death {i}"
            );
            tokio::time::sleep(Duration::from_millis(800)).await;
        }
        // Two within the window: the budget of one restart is spent.
        let _ = ping.call(PingRequest::Panic("a".into())).await;
        let _ = ping
            .call(PingRequest::Echo("up".into()))
            .await
            .expect("restarted");
        let _ = ping.call(PingRequest::Panic("b".into())).await;
        let e = ping.call(PingRequest::Echo("x".into())).await.unwrap_err();
        assert!(e.to_string().contains("died 2 times within 600ms"), "{e}");
    }

    #[tokio::test]
    async fn weights_pass_in_process_without_a_copy_and_stop_is_final() {
        let ping = spawn_local::<Ping>("p", (), SpawnOptions::default())
            .await
            .expect("starts");
        let params = Arc::new(kernels::tensor::TensorSet {
            tensors: vec![kernels::tensor::Tensor {
                name: "w".into(),
                shape: vec![2],
                data: vec![1.0, 2.0].into(),
            }],
        });
        let snapshot = WeightSnapshot::new(3, params.clone());
        ping.load_weights(snapshot).await.expect("taken");
        // The actor holds the same allocation: the sender's Arc count went up, no bytes copied.
        assert_eq!(Arc::strong_count(&params), 2);
        let r = ping.call(PingRequest::Weights).await.expect("answers");
        assert!(
            matches!(
                r,
                PingResponse::Weights {
                    version: Some(3),
                    tensors: 1,
                    bytes: 8,
                    ..
                }
            ),
            "{r:?}"
        );
        ping.stop();
        let e = ping.call(PingRequest::Echo("x".into())).await;
        // Stop is asynchronous: the call either raced in before it or sees the actor stopped.
        if let Err(e) = e {
            assert!(
                matches!(e, ActorError::Stopped { .. } | ActorError::Died { .. }),
                "{e}"
            );
        }
        while ping.location() != "down" {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let e = ping.call(PingRequest::Echo("x".into())).await.unwrap_err();
        assert_eq!(e.to_string(), "actor `p` was stopped");
    }

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        let p = RestartPolicy {
            max_restarts: 9,
            backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(500),
            ..Default::default()
        };
        let d: Vec<u128> = (1..=5).map(|n| p.delay(n).as_millis()).collect();
        assert_eq!(d, [100, 200, 400, 500, 500]);
    }
}
