//! Rank-to-rank exchange of f32 values: the data plane of a group's collectives (the learner
//! ranks' all-reduce), with no driver in the path.
//!
//! Each rank writes into its own [`Outbox`] — a shared-memory file — and reads ranges of the
//! others' outboxes: in place, through a mapping of the file, when the other rank is on this
//! host; over a TCP stream from the outbox's server otherwise (authenticated by the group's key,
//! every range checked by CRC-32C, as weight buckets are). A [`Group`] is one rank's view of
//! all of them: its reduce-scatter sums its shard of every rank's outbox in rank order (so
//! whichever rank owns a shard, the sum is the one a single process would make in that
//! order), and its all-gather reads every other rank's shard from its owner.
//!
//! Owns: the outboxes, their servers, the reads and the order of a sum. Does not own: what the
//! values mean, or when a phase may start — the caller orders the phases so that a range is
//! only read after its owner wrote it and before its owner writes it again (the learner pool
//! runs each phase on every rank and waits for all before the next). The streams are
//! authenticated but not encrypted, as NCCL's and gloo's are.

use crate::auth::Token;
use crate::snapshot::{ShmRegion, is_region};
use kernels::mem::f32_bytes_mut;
use memmap2::Mmap;
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Values a read moves at once (4 MB): large enough that a round trip hides behind the bytes,
/// small enough that a sum works on pieces still in cache and buffers stay small.
pub const CHUNK: usize = 1 << 20;

/// What a client sends first: this, then its key's length (u16 LE) and the key.
const MAGIC: &[u8; 8] = b"TRLSXCH1";

/// A stream that moves no byte for this long is stuck (its peer froze or vanished): the data
/// a rank reads was written before the phase began, so a live peer answers at once.
const STALL: Duration = Duration::from_secs(10);

/// The length an outbox server answers for a range it does not hold.
const REFUSED: u64 = u64::MAX;

/// What an exchange can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    /// This rank's outbox could not be made.
    #[error("cannot open an outbox of {values} values: {source}")]
    Outbox {
        values: usize,
        source: std::io::Error,
    },
    /// Another rank's outbox could not be reached or read.
    #[error("rank {rank}'s outbox at {at}: {message}")]
    Peer {
        rank: usize,
        at: String,
        message: String,
    },
    /// A group that cannot be formed as described.
    #[error("{0}")]
    Group(String),
}

type Result<T, E = ExchangeError> = std::result::Result<T, E>;

/// A failed exchange is a rank that was lost, or a link to one that broke: a call made again
/// (with new ranks) may pass.
impl From<ExchangeError> for crate::CallError {
    fn from(e: ExchangeError) -> Self {
        crate::CallError::retryable(e.to_string())
    }
}

/// How the ranks of a group reach each other's outboxes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reach {
    /// Mapped in place on the same host, streamed across hosts.
    #[default]
    Auto,
    /// Streamed always (ranks on one host that do not share its shared memory, as containers
    /// with private `/dev/shm`s).
    Streams,
}

/// `(offset, length)` pieces of at most [`CHUNK`] values covering `a..a + l`.
fn pieces(a: usize, l: usize) -> impl Iterator<Item = (usize, usize)> {
    (a..a + l)
        .step_by(CHUNK)
        .map(move |at| (at, CHUNK.min(a + l - at)))
}

/// Where a rank's outbox is: its host (as [`crate::head::host_id`] says), its file, and the
/// port its server listens on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutboxAddress {
    /// The host's id.
    pub host: String,
    /// The shared-memory file.
    pub path: String,
    /// The server's port.
    pub port: u16,
}

/// A rank of a group as the others see it: its outbox, and the host name or address its
/// server is reached at from another host.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Member {
    /// Where its outbox is.
    pub outbox: OutboxAddress,
    /// Its host as others reach it (its agent's advertised host; `127.0.0.1` in the driver).
    pub reach: String,
}

/// One rank's outbox: `values` f32 in a shared-memory file that ranks on this host map, served
/// to ranks on others. Removed (and its server stopped) when dropped.
pub struct Outbox {
    region: ShmRegion,
    values: usize,
    address: OutboxAddress,
    _server: Server,
}

impl Outbox {
    /// Makes an outbox of `values` zeros, served on `host` (the address other hosts reach
    /// this one at; every interface when it is not this host's own, as behind a NAT) to
    /// clients that present `key`.
    pub fn open(values: usize, key: &Token, host: &str) -> Result<Outbox> {
        let io = |source| ExchangeError::Outbox { values, source };
        let region = ShmRegion::create((values * 4) as u64).map_err(io)?;
        let view = map(region.path()).map_err(io)?;
        let server = Server::start(Arc::new(view), values, key.clone(), host).map_err(io)?;
        let address = OutboxAddress {
            host: crate::head::host_id(),
            path: region.path().to_string_lossy().into_owned(),
            port: server.port,
        };
        Ok(Outbox {
            region,
            values,
            address,
            _server: server,
        })
    }

    /// Where it is.
    pub fn address(&self) -> &OutboxAddress {
        &self.address
    }

    /// Its values, to write.
    pub fn values_mut(&mut self) -> &mut [f32] {
        let n = self.values;
        floats_mut(&mut self.region.bytes_mut()[..4 * n])
    }

    /// Its values.
    pub fn values(&self) -> &[f32] {
        floats(&self.region.bytes()[..4 * self.values])
    }
}

/// Maps `path` read-only.
fn map(path: &Path) -> std::io::Result<Mmap> {
    let file = std::fs::File::open(path)?;
    // SAFETY: the file is an outbox; its owner writes a range only in a phase where no rank
    // reads it (see the module's documentation), so a reader never sees a range change.
    unsafe { Mmap::map(&file) }
}

/// The f32 values of a page-aligned mapping's bytes.
fn floats(bytes: &[u8]) -> &[f32] {
    assert!(bytes.as_ptr().cast::<f32>().is_aligned() && bytes.len().is_multiple_of(4));
    // SAFETY: aligned (checked), whole values (checked), and every bit pattern is an f32.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), bytes.len() / 4) }
}

/// The f32 values of a page-aligned mapping's bytes, to write.
fn floats_mut(bytes: &mut [u8]) -> &mut [f32] {
    assert!(bytes.as_ptr().cast::<f32>().is_aligned() && bytes.len().is_multiple_of(4));
    // SAFETY: as `floats`, and the borrow is exclusive.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast(), bytes.len() / 4) }
}

/// How often an outbox's acceptor looks whether its server stopped.
const ACCEPT_POLL: Duration = Duration::from_millis(50);

/// An outbox's server: a thread accepting connections, a thread for each.
struct Server {
    port: u16,
    stop: Arc<AtomicBool>,
    streams: Arc<Mutex<Vec<TcpStream>>>,
    acceptor: Option<JoinHandle<()>>,
}

impl Server {
    fn start(view: Arc<Mmap>, values: usize, key: Token, host: &str) -> std::io::Result<Server> {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let listener = TcpListener::bind((host, 0)).or_else(|e| {
            tracing::debug!("an outbox serves every interface: {host} is not this host's ({e})");
            TcpListener::bind("0.0.0.0:0").or_else(|_| TcpListener::bind("[::]:0"))
        })?;
        let port = listener.local_addr()?.port();
        // Polled, so a stopping server never waits on a connection that may not come.
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let streams: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (stopping, open) = (stop.clone(), streams.clone());
        let acceptor = std::thread::Builder::new()
            .name("outbox-accept".into())
            .spawn(move || {
                while !stopping.load(Ordering::SeqCst) {
                    let stream = match listener.accept() {
                        Ok((s, _)) if s.set_nonblocking(false).is_ok() => s,
                        Ok(_) => continue,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(ACCEPT_POLL);
                            continue;
                        }
                        Err(e) => {
                            tracing::debug!("an outbox could not accept a connection: {e}");
                            std::thread::sleep(ACCEPT_POLL);
                            continue;
                        }
                    };
                    if let Ok(kept) = stream.try_clone() {
                        crate::lock(&open).push(kept);
                    }
                    let (view, key) = (view.clone(), key.clone());
                    let _ = std::thread::Builder::new()
                        .name("outbox-serve".into())
                        .spawn(move || {
                            if let Err(e) = serve(stream, &view, values, &key) {
                                tracing::debug!("an outbox connection ended: {e}");
                            }
                        });
                }
            })?;
        Ok(Server {
            port,
            stop,
            streams,
            acceptor: Some(acceptor),
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        for s in crate::lock(&self.streams).drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Serves one client: the handshake, then ranges until it hangs up.
fn serve(mut s: TcpStream, view: &Mmap, values: usize, key: &Token) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(STALL))?;
    s.set_write_timeout(Some(STALL))?;
    let mut magic = [0u8; 10];
    s.read_exact(&mut magic)?;
    let len = u16::from_le_bytes([magic[8], magic[9]]) as usize;
    let mut given = vec![0u8; len];
    s.read_exact(&mut given)?;
    let ok = &magic[..8] == MAGIC && std::str::from_utf8(&given).is_ok_and(|g| key.matches(g));
    s.write_all(&[u8::from(ok)])?;
    if !ok {
        tracing::warn!(peer = ?s.peer_addr().ok(), "an outbox refused a client without the group's key");
        return Ok(());
    }
    // Between phases a client may be quiet for minutes (generation runs meanwhile).
    s.set_read_timeout(None)?;
    let mut request = [0u8; 16];
    loop {
        match s.read_exact(&mut request) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let offset = u64::from_le_bytes(request[..8].try_into().unwrap_or_default()) as usize;
        let len = u64::from_le_bytes(request[8..].try_into().unwrap_or_default()) as usize;
        let mut header = [0u8; 12];
        let Some(end) = offset.checked_add(len).filter(|&e| e <= values) else {
            header[..8].copy_from_slice(&REFUSED.to_le_bytes());
            s.write_all(&header)?;
            continue;
        };
        let bytes = &view[4 * offset..4 * end];
        header[..8].copy_from_slice(&(len as u64).to_le_bytes());
        header[8..].copy_from_slice(&proto::crc32c(bytes).to_le_bytes());
        s.write_all(&header)?;
        s.write_all(bytes)?;
    }
}

/// Another rank's outbox as this rank reads it.
enum Peer {
    /// Its file, mapped (same host).
    Mapped(Mmap),
    /// A stream to its server (another host).
    Stream(Link),
}

impl Peer {
    /// Reaches `member`'s outbox of at least `values` values as rank `rank`.
    fn connect(
        rank: usize,
        member: &Member,
        values: usize,
        key: &Token,
        how: Reach,
    ) -> Result<Peer> {
        let a = &member.outbox;
        if how == Reach::Auto && a.host == crate::head::host_id() {
            let fail = |message: String| ExchangeError::Peer {
                rank,
                at: a.path.clone(),
                message,
            };
            if !is_region(Path::new(&a.path)) {
                return Err(fail("not a Trellis shared-memory file".into()));
            }
            let view = map(Path::new(&a.path)).map_err(|e| {
                fail(format!(
                    "{e} (ranks on one host that cannot open each other's /dev/shm files — containers, other users — need `allreduce: streams`)"
                ))
            })?;
            if view.len() < 4 * values {
                return Err(fail(format!("{} bytes, {} wanted", view.len(), 4 * values)));
            }
            return Ok(Peer::Mapped(view));
        }
        let host = member.reach.trim_start_matches('[').trim_end_matches(']');
        let at = if host.contains(':') {
            format!("[{host}]:{}", a.port)
        } else {
            format!("{host}:{}", a.port)
        };
        let fail = |message: String| ExchangeError::Peer {
            rank,
            at: at.clone(),
            message,
        };
        let addr = (host, a.port)
            .to_socket_addrs()
            .map_err(|e| fail(format!("cannot resolve: {e}")))?
            .next()
            .ok_or_else(|| fail("resolves to no address".into()))?;
        let mut stream = TcpStream::connect_timeout(&addr, STALL)
            .map_err(|e| fail(format!("cannot connect: {e}")))?;
        let setup = |s: &mut TcpStream| -> std::io::Result<bool> {
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(STALL))?;
            s.set_write_timeout(Some(STALL))?;
            let secret = key.secret().as_bytes();
            let mut hello = MAGIC.to_vec();
            hello.extend_from_slice(&(secret.len() as u16).to_le_bytes());
            hello.extend_from_slice(secret);
            s.write_all(&hello)?;
            let mut ok = [0u8; 1];
            s.read_exact(&mut ok)?;
            Ok(ok[0] == 1)
        };
        match setup(&mut stream) {
            Ok(true) => Ok(Peer::Stream(Link {
                stream,
                at,
                asked: Default::default(),
                broken: false,
            })),
            Ok(false) => Err(fail("refused this group's key".into())),
            Err(e) => Err(fail(format!("handshake: {e}"))),
        }
    }

    /// Asks for the values of `ranges` ((offset, length) each), to be read in that order
    /// (a mapping needs no asking).
    fn ask(&mut self, rank: usize, ranges: impl IntoIterator<Item = (usize, usize)>) -> Result<()> {
        match self {
            Peer::Mapped(_) => Ok(()),
            Peer::Stream(link) => link.ask(rank, ranges),
        }
    }

    /// Values `offset..offset + len`: a view of the mapping, or read into `buf` (asked for
    /// first unless an earlier [`Peer::ask`] did).
    fn read<'a>(
        &'a mut self,
        rank: usize,
        offset: usize,
        len: usize,
        buf: &'a mut Vec<f32>,
    ) -> Result<&'a [f32]> {
        match self {
            Peer::Mapped(view) => Ok(&floats(view)[offset..offset + len]),
            Peer::Stream(link) => {
                if link.asked.is_empty() {
                    link.ask(rank, [(offset, len)])?;
                }
                link.read(rank, offset, len, buf)?;
                Ok(buf)
            }
        }
    }
}

/// A stream to another rank's outbox server, with the ranges asked for and not yet read (a
/// phase asks for all of its ranges first, so the next arrives while one is summed).
struct Link {
    stream: TcpStream,
    at: String,
    asked: std::collections::VecDeque<(usize, usize)>,
    /// A read failed: the answers on the stream are no longer in step with the asks.
    broken: bool,
}

impl Link {
    fn fail(&self, rank: usize, message: String) -> ExchangeError {
        ExchangeError::Peer {
            rank,
            at: self.at.clone(),
            message,
        }
    }

    /// Fails once a read went wrong.
    fn usable(&self, rank: usize) -> Result<()> {
        match self.broken {
            true => Err(self.fail(rank, "an earlier read from it failed".into())),
            false => Ok(()),
        }
    }

    fn ask(&mut self, rank: usize, ranges: impl IntoIterator<Item = (usize, usize)>) -> Result<()> {
        self.usable(rank)?;
        let mut requests = Vec::new();
        for (offset, len) in ranges {
            requests.extend_from_slice(&(offset as u64).to_le_bytes());
            requests.extend_from_slice(&(len as u64).to_le_bytes());
            self.asked.push_back((offset, len));
        }
        if let Err(e) = self.stream.write_all(&requests) {
            self.broken = true;
            return Err(self.fail(rank, format!("sending requests: {e}")));
        }
        Ok(())
    }

    /// The next answer, which must be for `offset..offset + len`, into `buf`.
    fn read(&mut self, rank: usize, offset: usize, len: usize, buf: &mut Vec<f32>) -> Result<()> {
        self.usable(rank)?;
        // Any failure leaves the stream out of step with its asks.
        self.broken = true;
        if self.asked.pop_front() != Some((offset, len)) {
            return Err(self.fail(
                rank,
                format!(
                    "values {offset}..{} read out of the order they were asked in",
                    offset + len
                ),
            ));
        }
        let mut header = [0u8; 12];
        if let Err(e) = self.stream.read_exact(&mut header) {
            return Err(self.fail(rank, format!("no answer: {e}")));
        }
        let got = u64::from_le_bytes(header[..8].try_into().unwrap_or_default());
        if got != len as u64 {
            return Err(self.fail(
                rank,
                format!("refused values {offset}..{} (it holds fewer)", offset + len),
            ));
        }
        buf.resize(len, 0.0);
        if let Err(e) = self.stream.read_exact(f32_bytes_mut(buf)) {
            return Err(self.fail(rank, format!("reading {len} values: {e}")));
        }
        let crc = u32::from_le_bytes(header[8..].try_into().unwrap_or_default());
        let ours = proto::crc32c(kernels::mem::f32_bytes(buf));
        if crc != ours {
            return Err(self.fail(
                rank,
                format!(
                    "values {offset}..{} arrived with CRC-32C {ours:#010x}, sent with {crc:#010x}",
                    offset + len
                ),
            ));
        }
        self.broken = false;
        Ok(())
    }
}

/// A group's outboxes as the caller that formed it reads them: each member's shard, as the
/// member last published it there (the learner ranks' weights after a step).
pub struct Reader {
    peers: Vec<Peer>,
    shards: Vec<(usize, usize)>,
    buf: Vec<f32>,
}

impl Reader {
    /// Reaches every member's outbox (`members[i]` owning `shards[i]` of `values` values).
    pub fn connect(
        members: &[Member],
        shards: Vec<(usize, usize)>,
        values: usize,
        key: &Token,
        how: Reach,
    ) -> Result<Reader> {
        if members.len() != shards.len() {
            return Err(ExchangeError::Group(format!(
                "{} members with {} shards",
                members.len(),
                shards.len()
            )));
        }
        let peers = members
            .iter()
            .enumerate()
            .map(|(i, m)| Peer::connect(i, m, values, key, how))
            .collect::<Result<_>>()?;
        Ok(Reader {
            peers,
            shards,
            buf: Vec::new(),
        })
    }

    /// Every member's shard of its outbox, piece by piece, to `take(offset, values)`.
    pub fn read_shards<E: From<ExchangeError>>(
        &mut self,
        mut take: impl FnMut(usize, &[f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        for (i, (p, &(a, l))) in self.peers.iter_mut().zip(&self.shards).enumerate() {
            p.ask(i, pieces(a, l))?;
        }
        for (i, (p, &(a, l))) in self.peers.iter_mut().zip(&self.shards).enumerate() {
            for (at, n) in pieces(a, l) {
                take(at, p.read(i, at, n, &mut self.buf)?)?;
            }
        }
        Ok(())
    }
}

/// Where a group's members publish a vector (the learner ranks' weights after a step), for a
/// reader outside the group — a rollout engine on another agent reading the new weights from
/// the ranks themselves, each rank serving its shard, instead of from one sender.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Source {
    /// The members, rank order.
    pub members: Vec<Member>,
    /// Each member's (offset, length) of the vector.
    pub shards: Vec<(usize, usize)>,
    /// The vector's length.
    pub values: usize,
    /// The group's key (sent only over the actor channels, which the cluster authenticates).
    pub key: String,
    /// How the members' outboxes are reached.
    pub reach: Reach,
}

impl Source {
    /// Reads the whole vector, each member's shard from its outbox, piece by piece, to
    /// `take(offset, values)` (mapped where the member is on this host, streamed with CRC-32C
    /// checks otherwise).
    pub fn read<E: From<ExchangeError>>(
        &self,
        take: impl FnMut(usize, &[f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        let key = Token::new(&self.key).map_err(|e| ExchangeError::Group(e.to_string()))?;
        let mut reader = Reader::connect(
            &self.members,
            self.shards.clone(),
            self.values,
            &key,
            self.reach,
        )?;
        reader.read_shards(take)
    }
}

/// One rank's view of a group of ranks that reduce a vector of `values` f32 together: its
/// outbox, the others', and the contiguous shard of the vector each rank owns.
pub struct Group {
    rank: usize,
    shards: Vec<(usize, usize)>,
    outbox: Outbox,
    /// `None` at this rank's index.
    peers: Vec<Option<Peer>>,
    /// A buffer a rank's reads land in (streams only).
    bufs: Vec<Vec<f32>>,
}

impl Group {
    /// Joins the group as rank `rank` with `outbox`: `members[i]` is rank `i` (this one
    /// included), `shards[i]` the (offset, length) it owns; the shards must tile the outbox.
    pub fn join(
        outbox: Outbox,
        rank: usize,
        shards: Vec<(usize, usize)>,
        members: &[Member],
        key: &Token,
        how: Reach,
    ) -> Result<Group> {
        let values = outbox.values;
        let tiles = shards
            .iter()
            .try_fold(0usize, |at, &(a, l)| (a == at).then_some(a + l));
        if members.len() != shards.len() || rank >= shards.len() || tiles != Some(values) {
            return Err(ExchangeError::Group(format!(
                "rank {rank} of {} members with shards {shards:?} of {values} values",
                members.len()
            )));
        }
        if members[rank].outbox != outbox.address {
            return Err(ExchangeError::Group(format!(
                "rank {rank}'s member is not this outbox"
            )));
        }
        let peers = members
            .iter()
            .enumerate()
            .map(|(i, m)| {
                (i != rank)
                    .then(|| Peer::connect(i, m, values, key, how))
                    .transpose()
            })
            .collect::<Result<_>>()?;
        Ok(Group {
            rank,
            bufs: vec![Vec::new(); shards.len()],
            shards,
            outbox,
            peers,
        })
    }

    /// This rank's shard: (offset, length).
    pub fn shard(&self) -> (usize, usize) {
        self.shards[self.rank]
    }

    /// This rank's outbox, to write.
    pub fn outbox_mut(&mut self) -> &mut [f32] {
        self.outbox.values_mut()
    }

    /// Reads `ranges[i]` of rank `i`'s outbox (where given; this rank's own is left out),
    /// streamed ranges at once on threads of their own.
    fn read_all(&mut self, ranges: &[Option<(usize, usize)>]) -> Result<()> {
        std::thread::scope(|s| {
            let reads: Vec<_> = self
                .peers
                .iter_mut()
                .zip(self.bufs.iter_mut())
                .zip(ranges)
                .enumerate()
                .filter_map(|(i, ((p, buf), r))| match (p, r) {
                    (Some(p @ Peer::Stream(_)), Some((o, n))) => {
                        let (o, n) = (*o, *n);
                        Some(s.spawn(move || p.read(i, o, n, buf).map(|_| ())))
                    }
                    _ => None,
                })
                .collect();
            reads
                .into_iter()
                .try_for_each(|r| r.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
        })
    }

    /// Rank `i`'s values `offset..offset + len` after [`Group::read_all`] read them (mapped
    /// ones are read here).
    fn got(&self, i: usize, offset: usize, len: usize) -> &[f32] {
        if i == self.rank {
            return &self.outbox.values()[offset..offset + len];
        }
        match &self.peers[i] {
            Some(Peer::Mapped(view)) => &floats(view)[offset..offset + len],
            _ => &self.bufs[i][..len],
        }
    }

    /// Reduce-scatter: sums this rank's shard of every rank's outbox, in rank order (rank 0's
    /// values plus rank 1's, …), writes the sum into this rank's outbox and hands it to
    /// `take(offset, sum)` piece by piece.
    pub fn reduce_scatter<E: From<ExchangeError>>(
        &mut self,
        mut take: impl FnMut(usize, &[f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        let (a, l) = self.shard();
        for (i, p) in self.peers.iter_mut().enumerate() {
            if let Some(p) = p {
                p.ask(i, pieces(a, l))?;
            }
        }
        let mut sum = Vec::new();
        for (at, n) in pieces(a, l) {
            let ranges = vec![Some((at, n)); self.shards.len()];
            self.read_all(&ranges)?;
            sum.clear();
            sum.extend_from_slice(self.got(0, at, n));
            for i in 1..self.shards.len() {
                let v = self.got(i, at, n);
                sum.iter_mut().zip(v).for_each(|(s, v)| *s += v);
            }
            self.outbox.values_mut()[at..at + n].copy_from_slice(&sum);
            take(at, &sum)?;
        }
        Ok(())
    }

    /// All-gather: every other rank's shard of its outbox, piece by piece, to
    /// `take(offset, values)`.
    pub fn all_gather<E: From<ExchangeError>>(
        &mut self,
        mut take: impl FnMut(usize, &[f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        for (i, p) in self.peers.iter_mut().enumerate() {
            if let Some(p) = p {
                let (a, l) = self.shards[i];
                p.ask(i, pieces(a, l))?;
            }
        }
        let most = self.shards.iter().map(|s| s.1.div_ceil(CHUNK)).max();
        for k in 0..most.unwrap_or(0) {
            let ranges: Vec<_> = (0..self.shards.len())
                .map(|i| {
                    let (a, l) = self.shards[i];
                    let at = a + k * CHUNK;
                    (i != self.rank && at < a + l).then(|| (at, CHUNK.min(a + l - at)))
                })
                .collect();
            self.read_all(&ranges)?;
            for (i, r) in ranges.into_iter().enumerate() {
                if let Some((at, n)) = r {
                    take(at, self.got(i, at, n))?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` ranks' groups over `values` values, and a reader of their outboxes.
    fn groups(n: usize, values: usize, how: Reach) -> (Vec<Group>, Reader) {
        let key = Token::generate().unwrap();
        let outboxes: Vec<_> = (0..n)
            .map(|_| Outbox::open(values, &key, "127.0.0.1").unwrap())
            .collect();
        let members: Vec<_> = outboxes
            .iter()
            .map(|o| Member {
                outbox: o.address().clone(),
                reach: "127.0.0.1".into(),
            })
            .collect();
        let per = values.div_ceil(n);
        let shards: Vec<_> = (0..n)
            .map(|i| {
                (
                    (i * per).min(values),
                    per.min(values - (i * per).min(values)),
                )
            })
            .collect();
        let reader = Reader::connect(&members, shards.clone(), values, &key, how).unwrap();
        let groups = outboxes
            .into_iter()
            .enumerate()
            .map(|(r, o)| Group::join(o, r, shards.clone(), &members, &key, how).unwrap())
            .collect();
        (groups, reader)
    }

    /// Runs `f` on every group at once (the phase's barrier is the scope's end).
    fn phase<T: Send>(gs: &mut [Group], f: impl Fn(usize, &mut Group) -> T + Sync) -> Vec<T> {
        std::thread::scope(|s| {
            let f = &f;
            let hs: Vec<_> = gs
                .iter_mut()
                .enumerate()
                .map(|(r, g)| s.spawn(move || f(r, g)))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn an_all_reduce_equals_the_rank_order_sum_bit_for_bit_mapped_and_streamed() {
        // Values that make the order of a sum matter; a size with a partial last piece.
        let values = 2 * CHUNK + 12_345;
        let value = |r: usize, i: usize| {
            ((i * 7919 + r * 104_729) % 10_007) as f32 * 1e-3 + (r as f32 * 1e7)
        };
        for (n, how) in [(2, Reach::Auto), (3, Reach::Auto), (3, Reach::Streams)] {
            let (mut gs, mut reader) = groups(n, values, how);
            phase(&mut gs, |r, g| {
                g.outbox_mut()
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, v)| *v = value(r, i));
            });
            let mine = phase(&mut gs, |_, g| {
                let mut out = vec![0.0f32; values];
                g.reduce_scatter::<ExchangeError>(|at, sum| {
                    out[at..at + sum.len()].copy_from_slice(sum);
                    Ok(())
                })
                .unwrap();
                out
            });
            let gathered = phase(&mut gs, |r, g| {
                let mut out = mine[r].clone();
                g.all_gather::<ExchangeError>(|at, v| {
                    out[at..at + v.len()].copy_from_slice(v);
                    Ok(())
                })
                .unwrap();
                out
            });
            let want: Vec<u32> = (0..values)
                .map(|i| {
                    let mut s = value(0, i);
                    (1..n).for_each(|r| s += value(r, i));
                    s.to_bits()
                })
                .collect();
            for (r, got) in gathered.iter().enumerate() {
                let bits: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                assert!(bits == want, "rank {r} of {n} ({how:?})");
            }
            // The caller reads every rank's shard of its outbox: the sums each made.
            let mut read = vec![0.0f32; values];
            reader
                .read_shards::<ExchangeError>(|at, v| {
                    read[at..at + v.len()].copy_from_slice(v);
                    Ok(())
                })
                .unwrap();
            let bits: Vec<u32> = read.iter().map(|v| v.to_bits()).collect();
            assert!(bits == want, "the reader of {n} ({how:?})");
        }
    }

    #[test]
    fn a_client_without_the_groups_key_is_refused_and_a_bad_group_is_named() {
        let key = Token::generate().unwrap();
        let outbox = Outbox::open(16, &key, "127.0.0.1").unwrap();
        let member = Member {
            outbox: outbox.address().clone(),
            reach: "127.0.0.1".into(),
        };
        let other = Token::generate().unwrap();
        let Err(e) = Peer::connect(0, &member, 16, &other, Reach::Streams) else {
            panic!("a wrong key was let in")
        };
        assert!(e.to_string().contains("refused this group's key"), "{e}");
        // With the key: a range it does not hold is refused, naming it.
        let mut p = Peer::connect(0, &member, 16, &key, Reach::Streams).unwrap();
        let e = p.read(0, 10, 7, &mut Vec::new()).unwrap_err().to_string();
        assert!(e.contains("refused values 10..17"), "{e}");
        let e = Group::join(
            outbox,
            0,
            vec![(0, 8), (9, 7)],
            &[member.clone(), member],
            &key,
            Reach::Auto,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("shards [(0, 8), (9, 7)] of 16 values"), "{e}");
    }

    #[test]
    fn a_member_that_is_gone_fails_a_read_at_once_naming_it() {
        let key = Token::generate().unwrap();
        let outbox = Outbox::open(1 << 16, &key, "127.0.0.1").unwrap();
        let member = Member {
            outbox: outbox.address().clone(),
            reach: "127.0.0.1".into(),
        };
        let mut p = Peer::connect(3, &member, 1 << 16, &key, Reach::Streams).unwrap();
        p.read(3, 0, 1 << 16, &mut Vec::new()).unwrap();
        drop(outbox);
        let t = std::time::Instant::now();
        let e = p.read(3, 0, 8, &mut Vec::new()).unwrap_err().to_string();
        assert!(t.elapsed() < STALL, "{:?}", t.elapsed());
        let at = format!("rank 3's outbox at 127.0.0.1:{}", member.outbox.port);
        assert!(e.starts_with(&at), "{e}");
        // The stream is out of step with its asks from then on: later reads fail too.
        let e = p.read(3, 8, 8, &mut Vec::new()).unwrap_err().to_string();
        assert!(e.contains("an earlier read from it failed"), "{e}");
    }
}
