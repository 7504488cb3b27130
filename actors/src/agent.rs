//! The node agent (`trellis agent`): hosts actors on one machine for a head.
//!
//! It serves the `Agent` service, registers with the head (retrying while the head is not up,
//! exiting when the head refuses its token), sends heartbeats that carry the deaths of its
//! actors, re-registers when the head forgot it, and on shutdown stops every actor.
//!
//! Owns: hosting. Does not own: restarts or placement (the head's).

use crate::auth::Token;
use crate::error::ActorError;
use crate::head::{PROTOCOL_VERSION, host_id};
use crate::lock;
use crate::placement::Resources;
use crate::registry::{Hosted, Mailbox, Registry};
use crate::remote::{Wire, endpoint};
use crate::snapshot::{self, Assembler};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use proto::v1::agent_server::{Agent as AgentRpc, AgentServer};
use proto::v1::failure::Code;
use proto::v1::head_client::HeadClient;
use proto::v1::{
    CallFrame, DeadActor, Failure, HeartbeatRequest, RegisterRequest, ReplyFrame, ShmSnapshot,
    ShutdownReply, ShutdownRequest, SnapshotAck, SnapshotChunk, SpawnReply, SpawnRequest,
    StopReply, StopRequest, reply_frame, snapshot_chunk,
};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status, Streaming};

/// How to run an agent.
#[derive(Clone, Debug)]
pub struct AgentOptions {
    /// The head's URL, e.g. `http://10.0.0.1:7070`.
    pub head: String,
    /// Where to serve the `Agent` service (port 0 picks one).
    pub listen: SocketAddr,
    /// The URL the head should use to reach this agent (default: `http://<listen>`).
    pub advertise: Option<String>,
    pub name: String,
    pub resources: Resources,
    pub labels: BTreeMap<String, String>,
    pub token: Token,
    /// PEM certificate(s) to trust for a head served over TLS (`https://` URL); `None` for
    /// plain HTTP/2.
    pub tls_ca: Option<Vec<u8>>,
    /// PEM certificate chain and private key: serve the agent protocol over TLS (and advertise
    /// `https://`), as a head that serves TLS requires.
    pub tls_identity: Option<(Vec<u8>, Vec<u8>)>,
    pub registry: Registry,
    pub wire: Wire,
}

/// Why an agent stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cannot listen on {address}: {source}")]
    Bind {
        address: SocketAddr,
        source: std::io::Error,
    },
    #[error("the head at {head} refused this agent: {message}")]
    Refused { head: String, message: String },
    #[error("{0}")]
    Config(String),
}

struct Actor {
    mailbox: Arc<dyn Mailbox>,
    abort: AbortHandle,
    /// Why it ended, once it has: a call that finds it dead reports this reason.
    ended: Ended,
}

/// Set to the reason once an actor ended.
type Ended = watch::Receiver<Option<String>>;

struct State {
    registry: Registry,
    actors: Mutex<HashMap<String, Actor>>,
    died: Mutex<Vec<DeadActor>>,
    stop: watch::Sender<bool>,
    max_bucket: u64,
    /// The head's shared-memory regions, each mapped once; their bytes are the weights of the
    /// actors that took snapshots from them.
    shm: Arc<Mutex<snapshot::ShmViews>>,
    /// Snapshots handed to actors, whose memory the next push reuses once they let go.
    spares: Arc<Mutex<snapshot::Spares>>,
}

impl State {
    fn host(self: &Arc<Self>, actor_id: String, hosted: Hosted) {
        let (ended_tx, ended) = watch::channel(None);
        lock(&self.actors).insert(
            actor_id.clone(),
            Actor {
                mailbox: hosted.mailbox,
                abort: hosted.abort,
                ended,
            },
        );
        let state = Arc::downgrade(self);
        let death = hosted.death;
        tokio::spawn(async move {
            let reason = death.await.unwrap_or_else(|_| "its watcher ended".into());
            ended_tx.send_replace(Some(reason.clone()));
            if let Some(state) = state.upgrade() {
                tracing::info!(actor = %actor_id, %reason, "actor ended");
                lock(&state.actors).remove(&actor_id);
                lock(&state.died).push(DeadActor { actor_id, reason });
            }
        });
    }

    fn mailbox(&self, actor_id: &str) -> Result<Arc<dyn Mailbox>, Status> {
        self.actor(actor_id).map(|(m, _)| m)
    }

    fn actor(&self, actor_id: &str) -> Result<(Arc<dyn Mailbox>, Ended), Status> {
        lock(&self.actors)
            .get(actor_id)
            .map(|a| (a.mailbox.clone(), a.ended.clone()))
            .ok_or_else(|| Status::not_found(format!("no actor `{actor_id}` on this agent")))
    }

    fn stop_all(&self) {
        for (_, a) in lock(&self.actors).drain() {
            a.abort.abort();
        }
    }
}

struct Service(Arc<State>);

type ReplyStream = Pin<Box<dyn Stream<Item = Result<ReplyFrame, Status>> + Send>>;

fn snapshot_status(e: ActorError) -> Status {
    Status::invalid_argument(e.to_string())
}

#[tonic::async_trait]
impl AgentRpc for Service {
    async fn spawn(&self, request: Request<SpawnRequest>) -> Result<Response<SpawnReply>, Status> {
        let r = request.into_inner();
        if lock(&self.0.actors).contains_key(&r.actor_id) {
            return Err(Status::already_exists(format!(
                "actor `{}` already runs here",
                r.actor_id
            )));
        }
        let hosted = self
            .0
            .registry
            .start(
                &r.kind,
                r.actor_id.clone(),
                r.config,
                r.mailbox.max(1) as usize,
            )
            .await
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        self.0.host(r.actor_id, hosted);
        Ok(Response::new(SpawnReply {}))
    }

    type CallStream = ReplyStream;

    async fn call(
        &self,
        request: Request<Streaming<CallFrame>>,
    ) -> Result<Response<ReplyStream>, Status> {
        let mut frames = request.into_inner();
        let (tx, rx) = mpsc::channel::<Result<ReplyFrame, Status>>(4096);
        let state = self.0.clone();
        // One task reads the frames and drives every call in flight (no task per call: each
        // hop between tasks can be a wake-up of another core, tens of µs on small VMs).
        tokio::spawn(async move {
            let mut in_flight = FuturesUnordered::new();
            let mut reading = true;
            loop {
                tokio::select! {
                    frame = frames.message(), if reading => match frame {
                        Ok(Some(frame)) => {
                            let actor = state.actor(&frame.actor_id);
                            in_flight.push(answer(frame.id, actor, frame.payload));
                        }
                        _ => reading = false,
                    },
                    Some(reply) = in_flight.next(), if !in_flight.is_empty() => {
                        if tx.send(Ok(reply)).await.is_err() {
                            return;
                        }
                    }
                    else => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn stop(&self, request: Request<StopRequest>) -> Result<Response<StopReply>, Status> {
        let id = request.into_inner().actor_id;
        if let Some(a) = lock(&self.0.actors).get(&id) {
            a.abort.abort();
        }
        Ok(Response::new(StopReply {}))
    }

    async fn push_snapshot(
        &self,
        request: Request<Streaming<SnapshotChunk>>,
    ) -> Result<Response<SnapshotAck>, Status> {
        let mut chunks = request.into_inner();
        let header = match chunks.message().await? {
            Some(SnapshotChunk {
                part: Some(snapshot_chunk::Part::Header(h)),
            }) => h,
            _ => {
                return Err(Status::invalid_argument(
                    "a snapshot stream must start with its header",
                ));
            }
        };
        let manifest = header.manifest.unwrap_or_default();
        let mailbox = self.0.mailbox(&header.actor_id)?;
        let spare_pool = self.0.spares.clone();
        let mut assembler = Assembler::new(
            &header.actor_id,
            &manifest,
            self.0.max_bucket,
            &mut lock(&spare_pool),
        )
        .map_err(snapshot_status)?;
        while let Some(chunk) = chunks.message().await? {
            match chunk.part {
                Some(snapshot_chunk::Part::Bucket(b)) => {
                    if b.version != manifest.version {
                        return Err(Status::invalid_argument(format!(
                            "bucket {} belongs to version {}, the stream to {}",
                            b.index, b.version, manifest.version
                        )));
                    }
                    assembler
                        .push(b.index, &b.data, b.crc32c)
                        .map_err(snapshot_status)?;
                }
                _ => {
                    return Err(Status::invalid_argument(
                        "a second header in one snapshot stream",
                    ));
                }
            }
        }
        let (snapshot, ack) = assembler.finish().map_err(snapshot_status)?;
        if let Ok(params) = snapshot.params() {
            lock(&self.0.spares).keep(params.clone());
        }
        mailbox.load_weights(snapshot).await.map_err(|e| {
            Status::failed_precondition(format!("actor `{}`: {e}", header.actor_id))
        })?;
        Ok(Response::new(ack))
    }

    async fn push_snapshot_shm(
        &self,
        request: Request<ShmSnapshot>,
    ) -> Result<Response<SnapshotAck>, Status> {
        let r = request.into_inner();
        let mailbox = self.0.mailbox(&r.actor_id)?;
        let actor = r.actor_id.clone();
        let views = self.0.shm.clone();
        let (snapshot, mut ack) = tokio::task::spawn_blocking(move || {
            let manifest = r.manifest.unwrap_or_default();
            snapshot::read_shm(
                &r.actor_id,
                &manifest,
                &r.path,
                &r.crc32c,
                &mut lock(&views),
            )
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(snapshot_status)?;
        mailbox
            .load_weights(snapshot)
            .await
            .map_err(|e| Status::failed_precondition(format!("actor `{actor}`: {e}")))?;
        // After the actor took it (and perhaps let an older version go).
        ack.shm_in_use = lock(&self.0.shm).in_use();
        Ok(Response::new(ack))
    }

    async fn shutdown(
        &self,
        _: Request<ShutdownRequest>,
    ) -> Result<Response<ShutdownReply>, Status> {
        tracing::info!("the head asked this agent to shut down");
        self.0.stop.send_replace(true);
        Ok(Response::new(ShutdownReply {}))
    }
}

/// Runs one call frame against its actor and makes the reply frame.
async fn answer(
    id: u64,
    actor: Result<(Arc<dyn Mailbox>, Ended), Status>,
    payload: bytes::Bytes,
) -> ReplyFrame {
    let result = match actor {
        Ok((m, mut ended)) => match m.call(payload).await {
            Ok(payload) => reply_frame::Result::Payload(payload.into()),
            Err((Code::Died, message)) => {
                // Report why it died (the panic message), which its watcher learns a moment
                // after the call fails.
                let waited = tokio::time::timeout(
                    Duration::from_millis(200),
                    ended.wait_for(|r| r.is_some()),
                )
                .await;
                let reason = match waited {
                    Ok(Ok(r)) => r.clone().unwrap_or(message),
                    _ => message,
                };
                reply_frame::Result::Failure(Failure {
                    code: Code::Died as i32,
                    message: reason,
                })
            }
            Err((code, message)) => reply_frame::Result::Failure(Failure {
                code: code as i32,
                message,
            }),
        },
        Err(status) => reply_frame::Result::Failure(Failure {
            code: Code::NotFound as i32,
            message: status.message().to_string(),
        }),
    };
    ReplyFrame {
        id,
        result: Some(result),
    }
}

/// Runs an agent until `shutdown` resolves, the head asks it to stop, or the head refuses it.
pub async fn run(
    options: AgentOptions,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), AgentError> {
    let listener = tokio::net::TcpListener::bind(options.listen)
        .await
        .map_err(|source| AgentError::Bind {
            address: options.listen,
            source,
        })?;
    let bound = listener.local_addr().map_err(|source| AgentError::Bind {
        address: options.listen,
        source,
    })?;
    let scheme = if options.tls_identity.is_some() {
        "https"
    } else {
        "http"
    };
    let advertise = match &options.advertise {
        Some(a) => a.clone(),
        None if bound.ip().is_unspecified() => {
            let ip = route_to(&options.head).await.map_err(|e| {
                AgentError::Config(format!(
                    "listening on {bound}: cannot tell which address the head reaches this agent at ({e}); pass --advertise URL"
                ))
            })?;
            format!("{scheme}://{}", SocketAddr::new(ip, bound.port()))
        }
        None => format!("{scheme}://{bound}"),
    };
    let (stop, mut stopped) = watch::channel(false);
    let state = Arc::new(State {
        registry: options.registry.clone(),
        actors: Mutex::new(HashMap::new()),
        died: Mutex::new(Vec::new()),
        stop,
        max_bucket: options.wire.max_message_bytes as u64,
        shm: Arc::default(),
        spares: Arc::default(),
    });
    let service = InterceptedService::new(
        AgentServer::new(Service(state.clone()))
            .max_decoding_message_size(options.wire.max_message_bytes)
            .max_encoding_message_size(options.wire.max_message_bytes),
        options.token.guard(),
    );
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let mut server_stop = stopped.clone();
    let mut builder = tonic::transport::Server::builder();
    if let Some((cert, key)) = &options.tls_identity {
        builder = builder
            .tls_config(tonic::transport::ServerTlsConfig::new().identity(
                tonic::transport::Identity::from_pem(cert.clone(), key.clone()),
            ))
            .map_err(|e| AgentError::Config(format!("TLS: {e}")))?;
    }
    let server = tokio::spawn(
        builder
            .initial_stream_window_size(Some(32 << 20))
            .initial_connection_window_size(Some(64 << 20))
            .max_frame_size(Some(crate::remote::MAX_FRAME))
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = server_stop.wait_for(|s| *s).await;
            }),
    );
    tracing::info!(listen = %bound, %advertise, head = %options.head, "agent serving");

    let life = membership(&options, &advertise, &state);
    let result = tokio::select! {
        r = life => r,
        _ = shutdown => Ok(()),
        _ = stopped.wait_for(|s| *s) => Ok(()),
    };
    state.stop_all();
    state.stop.send_replace(true);
    // Graceful shutdown waits for open streams (the head's call stream): give it a moment.
    if tokio::time::timeout(Duration::from_secs(1), server)
        .await
        .is_err()
    {
        tracing::debug!("closing the head's open streams");
    }
    tracing::info!("agent stopped");
    result
}

/// This host's address on the route to the head at `url` (the source address the kernel picks
/// for it): where the head can reach an agent listening on every interface.
async fn route_to(url: &str) -> Result<std::net::IpAddr, String> {
    let uri: tonic::codegen::http::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
    let host = uri.host().ok_or_else(|| format!("{url} names no host"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = uri.port_u16().unwrap_or(80);
    let head = tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| format!("{host}: {e}"))?
        .next()
        .ok_or_else(|| format!("{host} resolves to no address"))?;
    let any: SocketAddr = if head.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    // Connecting a UDP socket sends nothing: it only picks the route and source address.
    let socket = std::net::UdpSocket::bind(any).map_err(|e| e.to_string())?;
    socket.connect(head).map_err(|e| format!("{head}: {e}"))?;
    socket
        .local_addr()
        .map(|a| a.ip())
        .map_err(|e| e.to_string())
}

/// Registers, heartbeats, and registers again when the head forgets this agent; returns only
/// when the head refuses it.
async fn membership(
    options: &AgentOptions,
    advertise: &str,
    state: &Arc<State>,
) -> Result<(), AgentError> {
    let mut endpoint = endpoint(&options.head).map_err(AgentError::Config)?;
    if let Some(ca) = &options.tls_ca {
        let tls = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(ca));
        endpoint = endpoint
            .tls_config(tls)
            .map_err(|e| AgentError::Config(format!("TLS to {}: {e}", options.head)))?;
    }
    let channel = endpoint.connect_lazy();
    let mut head = HeadClient::with_interceptor(channel, options.token.bearer());
    let register = RegisterRequest {
        name: options.name.clone(),
        address: advertise.to_string(),
        resources: Some(options.resources.into()),
        labels: options.labels.clone().into_iter().collect(),
        kinds: options.registry.kinds(),
        host_id: host_id(),
        protocol_version: PROTOCOL_VERSION,
    };
    loop {
        // Register, retrying while the head is unreachable.
        let mut wait = Duration::from_millis(100);
        let reply = loop {
            match head.register(register.clone()).await {
                Ok(r) => break r.into_inner(),
                Err(s)
                    if matches!(
                        s.code(),
                        tonic::Code::Unauthenticated
                            | tonic::Code::FailedPrecondition
                            | tonic::Code::InvalidArgument
                    ) =>
                {
                    return Err(AgentError::Refused {
                        head: options.head.clone(),
                        message: s.message().to_string(),
                    });
                }
                Err(s) => {
                    tracing::warn!(head = %options.head, "cannot register yet ({}); retrying in {wait:?}", s.message());
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(5));
                }
            }
        };
        tracing::info!(agent_id = %reply.agent_id, "registered with the head");
        let interval = Duration::from_millis(reply.heartbeat_interval_ms.max(10));
        loop {
            tokio::time::sleep(interval).await;
            let died: Vec<DeadActor> = std::mem::take(&mut *lock(&state.died));
            let beat = HeartbeatRequest {
                agent_id: reply.agent_id.clone(),
                died: died.clone(),
            };
            // Bounded: a heartbeat lost on a dead link must not stall the next ones.
            let reply = tokio::time::timeout(interval * 4, head.heartbeat(beat))
                .await
                .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("no answer")));
            match reply {
                Ok(r) if r.get_ref().known => {}
                Ok(_) => {
                    tracing::warn!(
                        "the head no longer knows this agent; stopping its actors and registering again"
                    );
                    state.stop_all();
                    lock(&state.died).clear();
                    break;
                }
                // A head that no longer takes this agent's token (it was restarted with a new
                // one) will never take it: stop, as a refused registration does.
                Err(s) if s.code() == tonic::Code::Unauthenticated => {
                    return Err(AgentError::Refused {
                        head: options.head.clone(),
                        message: s.message().to_string(),
                    });
                }
                Err(s) => {
                    tracing::warn!("heartbeat failed: {}", s.message());
                    lock(&state.died).extend(died);
                }
            }
        }
    }
}
