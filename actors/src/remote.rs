//! The head's side of one agent: a gRPC connection carrying every call to the agent's actors over
//! one bidirectional stream (calls matched to replies by id, so thousands can be in flight), and
//! weight snapshots streamed in buckets or handed over through shared memory.
//!
//! Owns: the connection and its failure. Does not own: deciding that an agent is dead (the head
//! does, from heartbeats and from this connection's end) or restarting anything.

use crate::auth::{Bearer, Token};
use crate::error::ActorError;
use crate::lock;
use crate::snapshot;
use bytes::Bytes;
use kernels::tensor::WeightSnapshot;
use proto::v1::agent_client::AgentClient;
use proto::v1::failure::Code;
use proto::v1::{
    CallFrame, Failure, ShmSnapshot, SnapshotChunk, SnapshotHeader, SpawnRequest, StopRequest,
    reply_frame, snapshot_chunk,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

/// Told `(actor_id, reason)` when a call finds its actor dead.
type ActorDied = Box<dyn Fn(&str, String) + Send + Sync>;
type Client = AgentClient<InterceptedService<Channel, Bearer>>;
type Pending = Mutex<HashMap<u64, oneshot::Sender<Result<Bytes, Failure>>>>;

/// Limits and tuning of head ↔ agent connections.
#[derive(Clone, Debug)]
pub struct Wire {
    /// Snapshot bucket size for gRPC streaming and shared memory.
    pub bucket_bytes: usize,
    /// Largest message either side accepts (a bucket plus framing must fit).
    pub max_message_bytes: usize,
    /// Hand snapshots to agents on the head's host through `/dev/shm` (else gRPC).
    pub shared_memory: bool,
}

impl Default for Wire {
    fn default() -> Self {
        Wire {
            bucket_bytes: snapshot::DEFAULT_BUCKET_BYTES,
            max_message_bytes: snapshot::DEFAULT_BUCKET_BYTES + (1 << 20),
            shared_memory: true,
        }
    }
}

/// An HTTP/2 endpoint tuned for bulk transfers (large windows) and low latency (no Nagle).
pub(crate) fn endpoint(address: &str) -> Result<Endpoint, String> {
    Ok(Endpoint::from_shared(address.to_string())
        .map_err(|e| format!("`{address}` is not a URL such as http://10.0.0.2:7171: {e}"))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        // A connection whose peer vanished (a cut link sends no reset) is noticed and redialled.
        .http2_keep_alive_interval(Duration::from_secs(2))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true)
        .initial_stream_window_size(Some(32 << 20))
        .initial_connection_window_size(Some(64 << 20))
        .max_frame_size(MAX_FRAME))
}

/// The largest HTTP/2 frame allowed: a 16 MiB bucket crosses in 16 frames rather than a
/// thousand 16 KiB ones, and the receiver starts copying it while the rest is on the wire
/// (16 MiB frames measured 0.7 GB/s, 1 MiB 2.0, 256 KiB 1.4 on loopback).
pub(crate) const MAX_FRAME: u32 = 1 << 20;

/// A live connection to one agent.
pub(crate) struct AgentConn {
    pub name: String,
    /// The URL it is reached at.
    pub address: String,
    client: Client,
    /// The same connection, for calls made with a codec of our own.
    service: InterceptedService<Channel, Bearer>,
    frames: mpsc::Sender<CallFrame>,
    pending: Arc<Pending>,
    closed: Arc<AtomicBool>,
    next_id: AtomicU64,
    same_host: bool,
    wire: Wire,
    on_actor_died: ActorDied,
    /// The shared-memory regions snapshots to this agent are written into (same host only).
    shm: tokio::sync::Mutex<snapshot::ShmPool>,
}

impl AgentConn {
    /// Connects to the agent at `address` (over TLS checked against `tls_ca`, when given) and
    /// opens the call stream; `on_lost` runs once when
    /// the stream ends (the agent died or the link broke), after every pending call has failed;
    /// `on_actor_died` when a call finds its actor dead (faster than the next heartbeat).
    pub(crate) async fn connect(
        name: &str,
        address: &str,
        token: &Token,
        tls_ca: Option<&[u8]>,
        same_host: bool,
        wire: Wire,
        on_lost: impl FnOnce(String) + Send + 'static,
        on_actor_died: impl Fn(&str, String) + Send + Sync + 'static,
    ) -> Result<Arc<AgentConn>, String> {
        let mut endpoint = endpoint(address)?;
        if let Some(ca) = tls_ca {
            let tls = tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(ca));
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| format!("TLS to {address}: {e}"))?;
        }
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| format!("cannot connect to {address}: {e}"))?;
        let service = InterceptedService::new(channel, token.bearer());
        let client = AgentClient::new(service.clone())
            .max_decoding_message_size(wire.max_message_bytes)
            .max_encoding_message_size(wire.max_message_bytes);
        let (frames, rx) = mpsc::channel(4096);
        let mut replies = client
            .clone()
            .call(ReceiverStream::new(rx))
            .await
            .map_err(|s| {
                format!(
                    "agent at {address} refused the call stream: {}",
                    s.message()
                )
            })?
            .into_inner();
        let pending: Arc<Pending> = Arc::default();
        let closed = Arc::new(AtomicBool::new(false));
        let (reader_pending, reader_closed) = (pending.clone(), closed.clone());
        tokio::spawn(async move {
            let reason = loop {
                match replies.message().await {
                    Ok(Some(frame)) => {
                        let result = match frame.result {
                            Some(reply_frame::Result::Payload(p)) => Ok(p),
                            Some(reply_frame::Result::Failure(f)) => Err(f),
                            None => Err(Failure {
                                code: Code::BadMessage as i32,
                                message: "empty reply".into(),
                            }),
                        };
                        let waiter = lock(&reader_pending).remove(&frame.id);
                        if let Some(waiter) = waiter {
                            let _ = waiter.send(result);
                        }
                    }
                    Ok(None) => break "the agent closed the call stream".to_string(),
                    Err(status) => break format!("the call stream broke: {}", status.message()),
                }
            };
            reader_closed.store(true, Ordering::SeqCst);
            let waiters: Vec<_> = lock(&reader_pending).drain().collect();
            for (_, w) in waiters {
                let _ = w.send(Err(Failure {
                    code: Code::Died as i32,
                    message: reason.clone(),
                }));
            }
            on_lost(reason);
        });
        Ok(Arc::new(AgentConn {
            name: name.to_string(),
            address: address.to_string(),
            client,
            service,
            frames,
            pending,
            closed,
            next_id: AtomicU64::new(1),
            same_host: same_host && wire.shared_memory,
            wire,
            on_actor_died: Box::new(on_actor_died),
            shm: tokio::sync::Mutex::default(),
        }))
    }

    fn agent_error(&self, message: String) -> ActorError {
        ActorError::Agent {
            agent: self.name.clone(),
            message,
        }
    }

    pub(crate) async fn spawn(&self, request: SpawnRequest) -> Result<(), ActorError> {
        let kind = request.kind.clone();
        let actor = request.actor_id.clone();
        self.client.clone().spawn(request).await.map_err(|s| {
            if s.code() == tonic::Code::InvalidArgument {
                ActorError::Start {
                    actor,
                    kind,
                    message: format!("on agent `{}`: {}", self.name, s.message()),
                }
            } else {
                self.agent_error(format!("spawn failed: {}", s.message()))
            }
        })?;
        Ok(())
    }

    pub(crate) async fn stop(&self, actor_id: &str) {
        let request = StopRequest {
            actor_id: actor_id.to_string(),
        };
        if let Err(s) = self.client.clone().stop(request).await {
            tracing::debug!(agent = %self.name, actor = actor_id, "stop: {}", s.message());
        }
    }

    pub(crate) async fn shutdown(&self) -> Result<(), ActorError> {
        self.client
            .clone()
            .shutdown(proto::v1::ShutdownRequest {})
            .await
            .map_err(|s| self.agent_error(format!("shutdown failed: {}", s.message())))?;
        Ok(())
    }

    /// One call: the request's JSON out, the response's JSON back.
    async fn call(&self, actor_id: &str, payload: Vec<u8>) -> Result<Bytes, Failure> {
        let lost = |message: &str| Failure {
            code: Code::Died as i32,
            message: message.to_string(),
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id, tx);
        if self.closed.load(Ordering::SeqCst) {
            lock(&self.pending).remove(&id);
            return Err(lost("the connection to its agent is closed"));
        }
        let frame = CallFrame {
            id,
            actor_id: actor_id.to_string(),
            payload: payload.into(),
        };
        if self.frames.send(frame).await.is_err() {
            lock(&self.pending).remove(&id);
            return Err(lost("the connection to its agent is closed"));
        }
        rx.await
            .unwrap_or_else(|_| Err(lost("the connection to its agent is closed")))
    }

    /// Fails every call waiting on this agent with `reason` and refuses new ones: the head
    /// declared it lost (its heartbeats stopped) while its connection may still look open — a
    /// frozen process, a host gone without a reset — so no caller waits for the transport to
    /// notice.
    pub(crate) fn abandon(&self, reason: &str) {
        self.closed.store(true, Ordering::SeqCst);
        let waiters: Vec<_> = lock(&self.pending).drain().collect();
        for (_, w) in waiters {
            let _ = w.send(Err(Failure {
                code: Code::Died as i32,
                message: reason.to_string(),
            }));
        }
    }

    /// A failed push: the agent's refusal, or — when the connection itself broke (a cut link,
    /// a killed agent) — the agent's loss, which callers treat like a call lost with its actor:
    /// the actor restarts elsewhere with the current weights, and the push can be made again.
    fn refused(&self, actor_id: &str, status: &tonic::Status) -> ActorError {
        let transport = std::error::Error::source(status).is_some()
            || status.code() == tonic::Code::Unavailable;
        if transport || self.closed.load(Ordering::SeqCst) {
            return ActorError::Agent {
                agent: self.name.clone(),
                message: format!(
                    "the connection broke during a weight push to `{actor_id}`: {}",
                    status.message()
                ),
            };
        }
        ActorError::Snapshot {
            actor: actor_id.to_string(),
            message: format!("agent `{}` refused it: {}", self.name, status.message()),
        }
    }

    async fn push_grpc(
        &self,
        actor_id: &str,
        s: &WeightSnapshot,
        bf16: Option<&[bool]>,
    ) -> Result<(u32, u32), ActorError> {
        let params = host_params(actor_id, s)?;
        let manifest = snapshot::manifest_as(s.version, params, self.wire.bucket_bytes, bf16);
        let header = SnapshotChunk {
            part: Some(snapshot_chunk::Part::Header(SnapshotHeader {
                actor_id: actor_id.to_string(),
                manifest: Some(manifest.clone()),
            })),
        };
        let crcs = Arc::new(Mutex::new(Vec::with_capacity(manifest.bucket_sizes.len())));
        let messages = snapshot::outgoing(header, params, &manifest, &crcs);
        // The generated client's method with the bucket codec: buckets are copied from the
        // tensors into the frames as HTTP/2 flow control lets them go.
        let mut grpc = tonic::client::Grpc::new(self.service.clone())
            .max_encoding_message_size(self.wire.max_message_bytes)
            .max_decoding_message_size(self.wire.max_message_bytes);
        grpc.ready().await.map_err(|e| {
            self.agent_error(format!(
                "the connection is not ready for a weight push to `{actor_id}`: {}",
                e
            ))
        })?;
        let ack = grpc
            .client_streaming(
                tonic::Request::new(tokio_stream::iter(messages)),
                tonic::codegen::http::uri::PathAndQuery::from_static(
                    "/trellis.v1.Agent/PushSnapshot",
                ),
                snapshot::BucketCodec,
            )
            .await
            .map_err(|st| self.refused(actor_id, &st))?
            .into_inner();
        check_version(actor_id, &ack, s.version)?;
        let sent = snapshot::digest(&lock(&crcs));
        Ok((sent, ack.digest))
    }

    async fn push_shm(&self, actor_id: &str, s: &WeightSnapshot) -> Result<(u32, u32), ActorError> {
        let params = host_params(actor_id, s)?;
        let manifest = snapshot::manifest(s.version, params, self.wire.bucket_bytes);
        // One push at a time per agent, into a region its last acknowledgement left free.
        let mut pool = self.shm.lock().await;
        let (snap, m, mut taken) = (params.clone(), manifest.clone(), std::mem::take(&mut *pool));
        let (taken, written) = tokio::task::spawn_blocking(move || {
            let written = taken.write(&snap, &m);
            (taken, written)
        })
        .await
        .map_err(|e| ActorError::Snapshot {
            actor: actor_id.to_string(),
            message: format!("writing shared memory failed: {e}"),
        })?;
        *pool = taken;
        let (path, crcs) = written.map_err(|e| ActorError::Snapshot {
            actor: actor_id.to_string(),
            message: format!("cannot write under {}: {e}", snapshot::SHM_DIR),
        })?;
        let request = ShmSnapshot {
            actor_id: actor_id.to_string(),
            manifest: Some(manifest),
            path,
            crc32c: crcs.clone(),
        };
        let mut ack = self
            .client
            .clone()
            .push_snapshot_shm(request)
            .await
            .map_err(|st| self.refused(actor_id, &st))?
            .into_inner();
        pool.acknowledged(std::mem::take(&mut ack.shm_in_use));
        check_version(actor_id, &ack, s.version)?;
        Ok((snapshot::digest(&crcs), ack.digest))
    }
}

/// The snapshot's weights on the host (read back from a device if they were left there), to send.
fn host_params<'s>(
    actor_id: &str,
    s: &'s WeightSnapshot,
) -> Result<&'s Arc<kernels::tensor::TensorSet>, ActorError> {
    s.params().map_err(|e| ActorError::Snapshot {
        actor: actor_id.to_string(),
        message: e.to_string(),
    })
}

fn check_version(
    actor_id: &str,
    ack: &proto::v1::SnapshotAck,
    sent: u64,
) -> Result<(), ActorError> {
    if ack.version == sent {
        return Ok(());
    }
    Err(ActorError::Snapshot {
        actor: actor_id.to_string(),
        message: format!("acknowledged version {} for version {sent}", ack.version),
    })
}

/// An actor living in an agent, as its handle reaches it.
#[derive(Clone)]
pub(crate) struct RemoteActor {
    pub conn: Arc<AgentConn>,
    pub actor_id: String,
}

impl RemoteActor {
    pub(crate) fn agent_name(&self) -> &str {
        &self.conn.name
    }

    pub(crate) fn agent_address(&self) -> &str {
        &self.conn.address
    }

    pub(crate) async fn stop(&self) {
        self.conn.stop(&self.actor_id).await;
    }

    /// One call with an encoded request; the encoded reply (the caller does the typing).
    pub(crate) async fn call(
        &self,
        name: &str,
        payload: Vec<u8>,
    ) -> Result<bytes::Bytes, ActorError> {
        match self.conn.call(&self.actor_id, payload).await {
            Ok(bytes) => Ok(bytes),
            Err(f) => Err(match f.code() {
                code @ (Code::Failed | Code::Unavailable) => ActorError::Failed {
                    actor: name.to_string(),
                    message: f.message,
                    retryable: code == Code::Unavailable,
                },
                Code::BadMessage => ActorError::BadMessage {
                    actor: name.to_string(),
                    message: f.message,
                },
                Code::Died | Code::NotFound | Code::Unspecified => {
                    (self.conn.on_actor_died)(&self.actor_id, f.message.clone());
                    ActorError::Died {
                        actor: name.to_string(),
                        reason: format!("on agent `{}`: {}", self.conn.name, f.message),
                    }
                }
            }),
        }
    }

    /// Pushes a snapshot (shared memory on the same host, gRPC otherwise: there the tensors
    /// `bf16` marks travel as bf16) and checks the receiver's digest against what was sent.
    pub(crate) async fn load_weights(
        &self,
        name: &str,
        snapshot: &WeightSnapshot,
        bf16: Option<&[bool]>,
    ) -> Result<(), ActorError> {
        let (sent, acked) = if self.conn.same_host {
            self.conn.push_shm(&self.actor_id, snapshot).await?
        } else {
            self.conn.push_grpc(&self.actor_id, snapshot, bf16).await?
        };
        if sent != acked {
            return Err(ActorError::Snapshot {
                actor: name.to_string(),
                message: format!(
                    "the receiver's digest {acked:#010x} differs from the sender's {sent:#010x}"
                ),
            });
        }
        Ok(())
    }
}
