//! Weight snapshots on the wire: a manifest, then the tensors' bytes as one stream cut into large
//! buckets (a tensor may span buckets), each checked by length and CRC-32C; and the same stream
//! written once into a shared-memory file for receivers on the same host.
//!
//! Owns: bucketing, verification, reassembly into [`WeightSnapshot`]s. Does not own: which
//! transport is used (the caller picks by where the receiver lives) or what the weights mean.

use crate::error::ActorError;
use bytes::BufMut;
use kernels::mem::{f32_bytes, f32_bytes_mut, zeroed_f32};
use kernels::tensor::WeightSnapshot;
use kernels::tensor::{Storage, Tensor, TensorSet};
use memmap2::{Mmap, MmapMut};
use prost::Message;
use proto::v1::{Dtype, SnapshotAck, SnapshotChunk, SnapshotManifest, TensorMeta};
use rayon::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

#[cfg(not(target_endian = "little"))]
compile_error!("snapshot buckets are little-endian f32: big-endian hosts are not supported");

/// Default bucket size: large enough that per-message costs vanish, small enough to pipeline.
pub const DEFAULT_BUCKET_BYTES: usize = 16 << 20;

/// Where shared-memory snapshots are written.
pub const SHM_DIR: &str = "/dev/shm";
const SHM_PREFIX: &str = "trellis-snapshot-";
/// The prefix of a file being made: it gets its lock and its pages under this name, and its
/// [`SHM_PREFIX`] name only then (by a rename), so a sweep never sees a region not yet locked.
const SHM_NEW_PREFIX: &str = "trellis-new-";
/// A file being made older than this was left by a process killed while making it.
const SHM_NEW_STALE: std::time::Duration = std::time::Duration::from_secs(60);

/// Lays the tensors of `params` (weight version `version`) out back to back and cuts the
/// stream into buckets of `bucket_bytes`.
pub fn manifest(version: u64, params: &TensorSet, bucket_bytes: usize) -> SnapshotManifest {
    manifest_as(version, params, bucket_bytes, None)
}

/// [`manifest`], with the tensors `bf16[i]` marks carried as bf16 (rounded to nearest, ties to
/// even: half the bytes) where they have an even number of values — so that every tensor
/// starts on a 4-byte boundary and buckets (then a multiple of 4 bytes) never cut a value.
/// The receiver widens them back to f32: for tensors it only reads through bf16 products.
pub fn manifest_as(
    version: u64,
    params: &TensorSet,
    bucket_bytes: usize,
    bf16: Option<&[bool]>,
) -> SnapshotManifest {
    let narrow = |i: usize, t: &Tensor| {
        bf16.is_some_and(|m| m.get(i).copied().unwrap_or(false)) && t.data.len().is_multiple_of(2)
    };
    let any = (0..params.tensors.len()).any(|i| narrow(i, &params.tensors[i]));
    let bucket_bytes = match any {
        true => bucket_bytes.max(4).next_multiple_of(4),
        false => bucket_bytes.max(1),
    } as u64;
    let mut offset = 0u64;
    let tensors = params
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let (dtype, width) = match narrow(i, t) {
                true => (Dtype::Bf16, 2),
                false => (Dtype::F32, 4),
            };
            let nbytes = (t.data.len() * width) as u64;
            let meta = TensorMeta {
                name: t.name.clone(),
                dtype: dtype as i32,
                shape: t.shape.iter().map(|&d| d as u64).collect(),
                bucket: (offset / bucket_bytes) as u32,
                offset,
                nbytes,
            };
            offset += nbytes;
            meta
        })
        .collect();
    let total = offset;
    let bucket_sizes = (0..total.div_ceil(bucket_bytes))
        .map(|i| bucket_bytes.min(total - i * bucket_bytes))
        .collect();
    SnapshotManifest {
        version,
        tensors,
        bucket_sizes,
    }
}

/// Bytes copied (and checksummed) at a time: the checksum reads them while they are in cache.
const PIECE: usize = 256 << 10;

/// Copies `src` to `dst` and returns `crc32c_append(crc, src)`, in cache-sized pieces so the
/// checksum reads bytes the copy just brought in. The stores bypass the cache: the
/// destination is not read again soon by this core, and a cached store would first read
/// every destination line from memory (a third of a copy's memory traffic).
fn copy_crc(crc: u32, src: &[u8], dst: &mut [u8]) -> u32 {
    let mut crc = crc;
    for (s, d) in src.chunks(PIECE).zip(dst.chunks_mut(PIECE)) {
        copy_streaming(s, d);
        crc = proto::crc32c_append(crc, s);
    }
    crc
}

/// `dst.copy_from_slice(src)` with non-temporal stores where the CPU has AVX.
fn copy_streaming(src: &[u8], dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU supports AVX, checked just above.
        unsafe { copy_streaming_avx(src, dst) };
        return;
    }
    dst.copy_from_slice(src);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn copy_streaming_avx(src: &[u8], dst: &mut [u8]) {
    use std::arch::x86_64::{__m256i, _mm_sfence, _mm256_loadu_si256, _mm256_stream_si256};
    assert_eq!(src.len(), dst.len());
    // Up to the first 32-byte aligned destination byte, then whole 32-byte blocks, then the rest.
    let head = dst.as_ptr().align_offset(32).min(dst.len());
    dst[..head].copy_from_slice(&src[..head]);
    let blocks = (dst.len() - head) / 32;
    for b in 0..blocks {
        let at = head + b * 32;
        // SAFETY: `at + 32 <= len` for both slices; the destination is 32-byte aligned (head);
        // loads are unaligned.
        unsafe {
            let v = _mm256_loadu_si256(src.as_ptr().add(at).cast::<__m256i>());
            _mm256_stream_si256(dst.as_mut_ptr().add(at).cast::<__m256i>(), v);
        }
    }
    let tail = head + blocks * 32;
    dst[tail..].copy_from_slice(&src[tail..]);
    // Streaming stores are weakly ordered: make them visible before anyone is told.
    _mm_sfence();
}

/// Which tensors of a manifest travel as bf16.
fn narrowed(tensors: &[TensorMeta]) -> Vec<bool> {
    tensors.iter().map(|t| t.dtype() == Dtype::Bf16).collect()
}

/// Values `src` as bf16 bytes (little-endian) into `dst` (two bytes each).
fn narrow_into(src: &[f32], dst: &mut [u8]) {
    for (v, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&kernels::bf16::bits(*v).to_le_bytes());
    }
}

/// bf16 bytes `src` (little-endian) widened into `dst` (one value per two bytes).
fn widen_into(src: &[u8], dst: &mut [f32]) {
    for (s, d) in src.chunks_exact(2).zip(dst) {
        *d = f32::from_bits((u16::from_le_bytes([s[0], s[1]]) as u32) << 16);
    }
}

/// Tensor start offsets in stream order, plus the total at the end.
fn starts(tensors: &[TensorMeta]) -> Vec<u64> {
    let mut v: Vec<u64> = tensors.iter().map(|t| t.offset).collect();
    v.push(tensors.last().map_or(0, |t| t.offset + t.nbytes));
    v
}

/// Copies stream bytes `[start, start + dst.len())` of `params` into `dst` (tensors `bf16`
/// marks as bf16); returns their CRC-32C.
fn gather(params: &TensorSet, starts: &[u64], bf16: &[bool], start: u64, dst: &mut [u8]) -> u32 {
    spans(starts, start, dst.len()).fold(0, |crc, (i, from, pos, n)| {
        let d = &mut dst[pos..pos + n];
        if bf16[i] {
            narrow_into(&params.tensors[i].data[from / 2..(from + n) / 2], d);
            return proto::crc32c_append(crc, d);
        }
        let src = f32_bytes(&params.tensors[i].data);
        copy_crc(crc, &src[from..from + n], d)
    })
}

/// The pieces of tensors that stream bytes `[start, start + len)` cover, in order, as
/// `(tensor, offset in the tensor, offset in the range, bytes)`; `starts` as made by
/// [`starts`] (the total at the end).
fn spans(
    starts: &[u64],
    start: u64,
    len: usize,
) -> impl Iterator<Item = (usize, usize, usize, usize)> + '_ {
    let tensors = starts.len().saturating_sub(1);
    let mut i = starts.partition_point(|&s| s <= start).saturating_sub(1);
    let mut pos = 0usize;
    std::iter::from_fn(move || {
        if pos >= len || i >= tensors {
            return None;
        }
        let from = (start + pos as u64 - starts[i]) as usize;
        let n = ((starts[i + 1] - starts[i]) as usize - from).min(len - pos);
        let span = (i, from, pos, n);
        pos += n;
        i += 1;
        Some(span)
    })
}

/// The bytes of bucket `index` and their CRC-32C (the encoder below writes the same bytes
/// straight into the frame; this is the reference it is tested against).
#[cfg(test)]
fn bucket(params: &TensorSet, manifest: &SnapshotManifest, index: usize) -> (Vec<u8>, u32) {
    let bucket_bytes = manifest.bucket_sizes.first().copied().unwrap_or(0);
    let mut out = vec![0u8; manifest.bucket_sizes[index] as usize];
    let crc = gather(
        params,
        &starts(&manifest.tensors),
        &narrowed(&manifest.tensors),
        index as u64 * bucket_bytes,
        &mut out,
    );
    (out, crc)
}

/// One message of a snapshot stream as the sender hands it to gRPC: the header, or a bucket
/// that is still the snapshot's tensors. [`BucketCodec`] copies a bucket's bytes straight from
/// the tensors into the HTTP/2 frame, checksumming each piece while it is in cache: no bucket
/// buffer, no second copy by a generic encoder.
pub(crate) enum Outgoing {
    Header(SnapshotChunk),
    Bucket {
        params: Arc<TensorSet>,
        starts: Arc<Vec<u64>>,
        /// The tensors that travel as bf16.
        bf16: Arc<Vec<bool>>,
        version: u64,
        index: u32,
        start: u64,
        len: usize,
        /// Each bucket's CRC-32C is appended here as it is encoded (buckets go in order).
        crcs: Arc<Mutex<Vec<u32>>>,
    },
}

/// The messages of one snapshot stream: its header, then every bucket of `manifest`.
pub(crate) fn outgoing(
    header: SnapshotChunk,
    params: &Arc<TensorSet>,
    manifest: &SnapshotManifest,
    crcs: &Arc<Mutex<Vec<u32>>>,
) -> Vec<Outgoing> {
    let starts = Arc::new(starts(&manifest.tensors));
    let bf16 = Arc::new(narrowed(&manifest.tensors));
    let bucket_bytes = manifest.bucket_sizes.first().copied().unwrap_or(0);
    let buckets = manifest
        .bucket_sizes
        .iter()
        .enumerate()
        .map(|(i, &len)| Outgoing::Bucket {
            params: params.clone(),
            starts: starts.clone(),
            bf16: bf16.clone(),
            version: manifest.version,
            index: i as u32,
            start: i as u64 * bucket_bytes,
            len: len as usize,
            crcs: crcs.clone(),
        });
    std::iter::once(Outgoing::Header(header))
        .chain(buckets)
        .collect()
}

/// The `PushSnapshot` codec on the sender's side: [`Outgoing`] out (encoded exactly as the
/// `SnapshotChunk` message the receiver's generated server decodes), `SnapshotAck` back.
#[derive(Clone, Copy, Default)]
pub(crate) struct BucketCodec;

pub(crate) struct BucketEncoder;
pub(crate) struct AckDecoder;

impl Codec for BucketCodec {
    type Encode = Outgoing;
    type Decode = SnapshotAck;
    type Encoder = BucketEncoder;
    type Decoder = AckDecoder;

    fn encoder(&mut self) -> BucketEncoder {
        BucketEncoder
    }

    fn decoder(&mut self) -> AckDecoder {
        AckDecoder
    }
}

fn varint_len(v: u64) -> usize {
    prost::encoding::encoded_len_varint(v)
}

impl Encoder for BucketEncoder {
    type Item = Outgoing;
    type Error = Status;

    fn encode(&mut self, item: Outgoing, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        let (params, starts, bf16, version, index, start, len, crcs) = match item {
            Outgoing::Header(chunk) => {
                return chunk
                    .encode(dst)
                    .map_err(|e| Status::internal(format!("encoding a snapshot header: {e}")));
            }
            Outgoing::Bucket {
                params,
                starts,
                bf16,
                version,
                index,
                start,
                len,
                crcs,
            } => (params, starts, bf16, version, index, start, len, crcs),
        };
        // SnapshotChunk { bucket (2): SnapshotBucket { version (1), index (2), data (3),
        // crc32c (4, fixed32) } }: every length is known before the data is copied.
        let inner = 1
            + varint_len(version)
            + 1
            + varint_len(u64::from(index))
            + 1
            + varint_len(len as u64)
            + len
            + 5;
        dst.reserve(1 + varint_len(inner as u64) + inner);
        dst.put_u8(2 << 3 | 2);
        prost::encoding::encode_varint(inner as u64, dst);
        dst.put_u8(1 << 3);
        prost::encoding::encode_varint(version, dst);
        dst.put_u8(2 << 3);
        prost::encoding::encode_varint(u64::from(index), dst);
        dst.put_u8(3 << 3 | 2);
        prost::encoding::encode_varint(len as u64, dst);
        let crc = gather_into(&params, &starts, &bf16, start, len, dst);
        dst.put_u8(4 << 3 | 5);
        dst.put_u32_le(crc);
        crate::lock(&crcs).push(crc);
        Ok(())
    }

    fn buffer_settings(&self) -> tonic::codec::BufferSettings {
        // Hand each bucket to HTTP/2 as soon as it is encoded.
        tonic::codec::BufferSettings::new(8 << 10, 1)
    }
}

impl Decoder for AckDecoder {
    type Item = SnapshotAck;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<SnapshotAck>, Status> {
        SnapshotAck::decode(src)
            .map(Some)
            .map_err(|e| Status::internal(format!("a malformed snapshot acknowledgement: {e}")))
    }
}

/// Appends stream bytes `[start, start + len)` of `params` (tensors `bf16` marks as bf16) to
/// `dst`; returns their CRC-32C.
fn gather_into(
    params: &TensorSet,
    starts: &[u64],
    bf16: &[bool],
    start: u64,
    len: usize,
    dst: &mut impl BufMut,
) -> u32 {
    let (mut crc, mut written) = (0, 0);
    let mut narrow = Vec::new();
    for (i, from, _, n) in spans(starts, start, len) {
        if bf16[i] {
            let values = &params.tensors[i].data[from / 2..(from + n) / 2];
            for piece in values.chunks(PIECE / 2) {
                narrow.resize(piece.len() * 2, 0);
                narrow_into(piece, &mut narrow);
                dst.put_slice(&narrow);
                crc = proto::crc32c_append(crc, &narrow);
            }
            written += n;
            continue;
        }
        let src = f32_bytes(&params.tensors[i].data);
        for piece in src[from..from + n].chunks(PIECE) {
            dst.put_slice(piece);
            crc = proto::crc32c_append(crc, piece);
        }
        written += n;
    }
    debug_assert_eq!(written, len, "the manifest was made from these tensors");
    crc
}

/// The digest a receiver acknowledges: CRC-32C over every bucket's CRC-32C, little-endian.
pub fn digest(crcs: &[u32]) -> u32 {
    let bytes: Vec<u8> = crcs.iter().flat_map(|c| c.to_le_bytes()).collect();
    proto::crc32c(&bytes)
}

/// CRC-32C of every tensor's bytes in order: what an actor holding the snapshot can report so
/// that a sender checks the weights arrived unchanged, whatever the bucketing.
pub fn content_crc(params: &TensorSet) -> u32 {
    params
        .tensors
        .iter()
        .fold(0, |crc, t| proto::crc32c_append(crc, f32_bytes(&t.data)))
}

/// Raw views of the destination tensors, so that threads can fill disjoint byte ranges.
struct Dest(Vec<(usize, usize)>);

impl Dest {
    fn of(tensors: &mut [Tensor]) -> Dest {
        Dest(
            tensors
                .iter_mut()
                .map(|t| {
                    let b = f32_bytes_mut(&mut t.data);
                    (b.as_mut_ptr() as usize, b.len())
                })
                .collect(),
        )
    }
}

/// Copies `src`, the stream bytes from `start`, into the tensors of `dest` (widening the ones
/// `bf16` marks); returns their CRC-32C. Calls running at once must cover disjoint ranges.
fn scatter(dest: &Dest, starts: &[u64], bf16: &[bool], start: u64, src: &[u8]) -> u32 {
    spans(starts, start, src.len()).fold(0, |crc, (i, from, pos, n)| {
        let (ptr, len) = dest.0[i];
        // SAFETY: `ptr..ptr+len` is tensor i's live allocation (borrowed mutably by `Dest::of`'s
        // caller for as long as `dest` is used), and callers give disjoint stream ranges, so no
        // two threads write the same bytes.
        let dst = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
        let src = &src[pos..pos + n];
        if bf16[i] {
            // Two wire bytes a value; the tensor's bytes hold four.
            let values = f32s_mut(&mut dst[2 * from..2 * (from + n)]);
            widen_into(src, values);
            return proto::crc32c_append(crc, src);
        }
        copy_crc(crc, src, &mut dst[from..from + n])
    })
}

/// A tensor's bytes (from an f32 allocation, 4-aligned offsets) as its values.
fn f32s_mut(bytes: &mut [u8]) -> &mut [f32] {
    debug_assert!(bytes.len().is_multiple_of(4) && bytes.as_ptr().align_offset(4) == 0);
    // SAFETY: the bytes are a 4-aligned whole-value range of an f32 allocation.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<f32>(), bytes.len() / 4) }
}

/// Snapshots a receiver handed on, kept so that a later snapshot of the same layout can reuse
/// their memory once nobody else holds them (fresh gigabytes cost more to fault in than to
/// fill on many machines).
#[derive(Default)]
pub struct Spares(Vec<Arc<TensorSet>>);

impl Spares {
    /// Keeps `params` (the latest few only).
    pub fn keep(&mut self, params: Arc<TensorSet>) {
        self.0.push(params);
        if self.0.len() > 3 {
            self.0.remove(0);
        }
    }

    /// A kept snapshot that nobody else holds and whose tensors have the manifest's names and
    /// shapes.
    fn take(&mut self, manifest: &SnapshotManifest) -> Option<TensorSet> {
        let fits = |p: &TensorSet| {
            p.tensors.len() == manifest.tensors.len()
                && p.tensors.iter().zip(&manifest.tensors).all(|(t, m)| {
                    t.name == m.name
                        && t.shape.len() == m.shape.len()
                        && t.shape.iter().zip(&m.shape).all(|(&a, &b)| a as u64 == b)
                })
        };
        let i = self
            .0
            .iter()
            .position(|p| Arc::strong_count(p) == 1 && fits(p))?;
        Arc::try_unwrap(self.0.remove(i)).ok()
    }
}

/// Checks a manifest: f32 tensors (or, where `bf16` allows, bf16 tensors of an even number of
/// values, with buckets of whole 4-byte words) laid back to back, shapes that match their
/// sizes, buckets that add up to the tensors; returns each tensor's byte offset.
fn check_manifest(
    actor: &str,
    manifest: &SnapshotManifest,
    bf16: bool,
) -> Result<Vec<u64>, ActorError> {
    let bad = |message: String| ActorError::Snapshot {
        actor: actor.to_string(),
        message,
    };
    if manifest.tensors.is_empty() {
        return Err(bad("the manifest lists no tensors".into()));
    }
    let mut offset = 0u64;
    let mut offsets = Vec::with_capacity(manifest.tensors.len());
    for t in &manifest.tensors {
        let width = match t.dtype() {
            Dtype::F32 => 4,
            Dtype::Bf16 if bf16 => 2,
            other => {
                return Err(bad(format!(
                    "tensor `{}` is {other:?}; snapshots carry f32{}",
                    t.name,
                    if bf16 { " or bf16" } else { " here" }
                )));
            }
        };
        let numel = t.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        if width == 2 && numel.is_some_and(|n| n % 2 == 1) {
            return Err(bad(format!(
                "bf16 tensor `{}` has an odd number of values",
                t.name
            )));
        }
        if numel.and_then(|n| n.checked_mul(width)) != Some(t.nbytes) {
            return Err(bad(format!(
                "tensor `{}` has shape {:?} but {} bytes",
                t.name, t.shape, t.nbytes
            )));
        }
        if t.offset != offset {
            return Err(bad(format!(
                "tensor `{}` starts at byte {} but the previous one ends at {offset}",
                t.name, t.offset
            )));
        }
        offsets.push(offset);
        offset += t.nbytes;
    }
    let total: u64 = manifest.bucket_sizes.iter().sum();
    if total != offset {
        return Err(bad(format!(
            "buckets hold {total} bytes but the tensors need {offset}"
        )));
    }
    let narrow = manifest.tensors.iter().any(|t| t.dtype() == Dtype::Bf16);
    let cuts = manifest.bucket_sizes.iter().rev().skip(1);
    if narrow && cuts.clone().any(|b| b % 4 != 0) {
        return Err(bad(
            "buckets of a snapshot with bf16 tensors must hold whole 4-byte words".into(),
        ));
    }
    Ok(offsets)
}

/// Rebuilds a snapshot from its manifest and buckets, verifying every step.
pub struct Assembler {
    actor: String,
    version: u64,
    starts: Vec<u64>,
    bf16: Vec<bool>,
    tensors: Vec<Tensor>,
    sizes: Vec<u64>,
    next: usize,
    position: u64,
    crcs: Vec<u32>,
}

impl Assembler {
    /// Checks the manifest (f32 tensors laid back to back, sizes that add up, no bucket over
    /// `max_bucket` bytes) and allocates the tensors, reusing a spare snapshot's where one of the
    /// same layout is free.
    pub fn new(
        actor: &str,
        manifest: &SnapshotManifest,
        max_bucket: u64,
        spares: &mut Spares,
    ) -> Result<Self, ActorError> {
        let bad = |message: String| ActorError::Snapshot {
            actor: actor.to_string(),
            message,
        };
        check_manifest(actor, manifest, true)?;
        let mut spare = spares.take(manifest).map(|p| p.tensors.into_iter());
        let tensors = manifest
            .tensors
            .iter()
            .map(|t| {
                // Every byte of every tensor is overwritten by the buckets: a spare needs no
                // zeroing.
                match spare.as_mut().and_then(Iterator::next) {
                    Some(reused) => reused,
                    None => Tensor {
                        name: t.name.clone(),
                        shape: t.shape.iter().map(|&d| d as usize).collect(),
                        data: zeroed_f32(t.shape.iter().product::<u64>() as usize).into(),
                    },
                }
            })
            .collect();
        if let Some(big) = manifest.bucket_sizes.iter().find(|&&b| b > max_bucket) {
            return Err(bad(format!(
                "a bucket of {big} bytes exceeds the limit of {max_bucket}"
            )));
        }
        Ok(Assembler {
            actor: actor.to_string(),
            version: manifest.version,
            starts: starts(&manifest.tensors),
            bf16: narrowed(&manifest.tensors),
            tensors,
            sizes: manifest.bucket_sizes.clone(),
            next: 0,
            position: 0,
            crcs: Vec::with_capacity(manifest.bucket_sizes.len()),
        })
    }

    fn error(&self, message: String) -> ActorError {
        ActorError::Snapshot {
            actor: self.actor.clone(),
            message,
        }
    }

    /// Takes the next bucket; refuses one out of order, of the wrong length or checksum.
    pub fn push(&mut self, index: u32, data: &[u8], crc: u32) -> Result<(), ActorError> {
        self.check(index, data.len() as u64)?;
        let actual = scatter(
            &Dest::of(&mut self.tensors),
            &self.starts,
            &self.bf16,
            self.position,
            data,
        );
        if actual != crc {
            return Err(self.error(format!(
                "bucket {index} arrived corrupted: CRC-32C {actual:#010x}, sender said {crc:#010x}"
            )));
        }
        self.advance(data.len() as u64, crc);
        Ok(())
    }

    fn check(&self, index: u32, len: u64) -> Result<(), ActorError> {
        if index as usize != self.next {
            return Err(self.error(format!(
                "bucket {index} arrived where bucket {} was expected",
                self.next
            )));
        }
        let Some(&size) = self.sizes.get(self.next) else {
            return Err(self.error(format!(
                "bucket {index} is beyond the manifest's {} buckets",
                self.sizes.len()
            )));
        };
        if len != size {
            return Err(self.error(format!(
                "bucket {index} has {len} bytes; the manifest says {size}"
            )));
        }
        Ok(())
    }

    fn advance(&mut self, len: u64, crc: u32) {
        self.position += len;
        self.crcs.push(crc);
        self.next += 1;
    }

    /// The snapshot and its acknowledgement, once every bucket arrived.
    pub fn finish(self) -> Result<(WeightSnapshot, SnapshotAck), ActorError> {
        if self.next != self.sizes.len() {
            return Err(self.error(format!(
                "the stream ended after {} of {} buckets",
                self.next,
                self.sizes.len()
            )));
        }
        let ack = SnapshotAck {
            version: self.version,
            bytes: self.position,
            digest: digest(&self.crcs),
            shm_in_use: Vec::new(),
        };
        let snapshot = WeightSnapshot::new(
            self.version,
            Arc::new(TensorSet {
                tensors: self.tensors,
            }),
        );
        Ok((snapshot, ack))
    }
}

/// Whether `file` can be locked exclusively now: `lock_shared` on a live region's file (held
/// until its process ends, whatever kills it) says no.
fn lock(file: &std::fs::File, how: libc::c_int) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor we own; the lock goes with the descriptor.
    unsafe { libc::flock(file.as_raw_fd(), how | libc::LOCK_NB) == 0 }
}

/// Removes the snapshot files under `dir` no live process holds (their sender was killed
/// before it could remove them): a sender holds a shared lock on its file for its life, which
/// the kernel drops with the process, in whatever namespace it ran. A file being made (not
/// yet locked) is left alone until it is [`SHM_NEW_STALE`].
fn remove_dead_processes_files(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let made = if name.starts_with(SHM_PREFIX) {
            true
        } else if name.starts_with(SHM_NEW_PREFIX) {
            false
        } else {
            continue;
        };
        let stale = || {
            entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > SHM_NEW_STALE))
        };
        if let Ok(f) = std::fs::File::open(entry.path())
            && (made || stale())
            && lock(&f, libc::LOCK_EX)
        {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Gives `file` its `len` bytes of pages now: a shared-memory file system without room for them
/// (a container's 64 MB `/dev/shm`) fails here, by name, instead of killing the process with
/// SIGBUS at the first write past its room.
fn reserve(file: &std::fs::File, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let len = libc::off_t::try_from(len).map_err(std::io::Error::other)?;
    // SAFETY: a descriptor we own; the range is within the file's new length.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
        0 => Ok(()),
        // A file system that cannot reserve: its pages come at the first write, as before.
        libc::EOPNOTSUPP | libc::EINVAL => Ok(()),
        libc::ENOSPC => Err(std::io::Error::other(format!(
            "{SHM_DIR} has no room for {len} bytes (a container's /dev/shm is 64 MB unless it is given more, e.g. docker run --shm-size)"
        ))),
        e => Err(std::io::Error::from_raw_os_error(e)),
    }
}

/// Whether `p` names a file [`ShmRegion::create`] makes: directly under [`SHM_DIR`], with
/// Trellis's prefix (the only files a receiver opens by a path it was sent).
pub(crate) fn is_region(p: &Path) -> bool {
    p.parent() == Some(Path::new(SHM_DIR))
        && p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(SHM_PREFIX))
}

/// A shared-memory file a sender writes snapshots into (pages are allocated once, not per
/// push); removed when dropped.
pub struct ShmRegion {
    path: PathBuf,
    map: MmapMut,
    /// The open file, whose shared lock says the region is in use.
    _file: std::fs::File,
}

impl Drop for ShmRegion {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl ShmRegion {
    /// Creates a new file of `len` bytes under [`SHM_DIR`], mode 0600. The first one a
    /// process makes also removes the files of processes that died without removing theirs
    /// (killed with -9).
    pub fn create(len: u64) -> std::io::Result<ShmRegion> {
        static SWEPT: std::sync::Once = std::sync::Once::new();
        SWEPT.call_once(|| remove_dead_processes_files(Path::new(SHM_DIR)));
        Self::create_in(Path::new(SHM_DIR), len)
    }

    /// [`ShmRegion::create`] under `dir`, without the sweep.
    fn create_in(dir: &Path, len: u64) -> std::io::Result<ShmRegion> {
        use std::os::unix::fs::OpenOptionsExt;
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("{}-{n}", std::process::id());
        let new = dir.join(format!("{SHM_NEW_PREFIX}{name}"));
        let path = dir.join(format!("{SHM_PREFIX}{name}"));
        let open = || {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&new)
        };
        let file = match open() {
            // Our process id in the name: the file is a dead process's that had it before,
            // so it is replaced.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                std::fs::remove_file(&new)?;
                open()?
            }
            r => r?,
        };
        // Held for the file's life: it tells a sweep (above, in another process) it is in use.
        // Taken before the file has its name, so no sweep ever finds it unlocked.
        lock(&file, libc::LOCK_SH);
        // A file already at `path` is a dead process's that had our process id (a receiver
        // still mapping it keeps its pages); the rename replaces it.
        if let Err(e) = file
            .set_len(len.max(1))
            .and_then(|()| reserve(&file, len.max(1)))
            .and_then(|()| std::fs::rename(&new, &path))
        {
            let _ = std::fs::remove_file(&new);
            return Err(e);
        }
        // SAFETY: we created the file with O_EXCL and mode 0600; the receiver maps it read-only
        // and we write it only while the receiver does not use it (see `ShmPool`).
        match unsafe { MmapMut::map_mut(&file) } {
            Ok(map) => Ok(ShmRegion {
                path: path.clone(),
                map,
                _file: file,
            }),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The region's bytes, for a writer that lays them out itself.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }

    /// The region's bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Writes `snapshot` at the start of the region, buckets copied and checksummed in
    /// parallel; returns each bucket's CRC-32C.
    pub fn write(&mut self, params: &TensorSet, manifest: &SnapshotManifest) -> Vec<u32> {
        let total: u64 = manifest.bucket_sizes.iter().sum();
        let bucket_bytes = manifest.bucket_sizes.first().copied().unwrap_or(1) as usize;
        let starts = starts(&manifest.tensors);
        let bf16 = narrowed(&manifest.tensors);
        self.map[..total as usize]
            .par_chunks_mut(bucket_bytes)
            .enumerate()
            .map(|(i, chunk)| gather(params, &starts, &bf16, (i * bucket_bytes) as u64, chunk))
            .collect()
    }
}

/// A sender's regions for one receiver. The receiver uses a snapshot's region in place as its
/// weights, so a push goes into a region the receiver said (in its last acknowledgement) it no
/// longer uses: two regions alternate in the steady state, a third appears while an old
/// version is still held (a generation that started before a swap).
#[derive(Default)]
pub struct ShmPool {
    regions: Vec<ShmRegion>,
    in_use: Vec<String>,
}

/// Most regions a sender keeps per receiver (unused ones beyond it are removed).
const MAX_REGIONS: usize = 4;

impl ShmPool {
    /// Writes `params` as `manifest` lays them out into a region the receiver does not use
    /// (a new one if none fits); returns the file's path and each bucket's CRC-32C.
    pub fn write(
        &mut self,
        params: &TensorSet,
        manifest: &SnapshotManifest,
    ) -> std::io::Result<(String, Vec<u32>)> {
        let total: u64 = manifest.bucket_sizes.iter().sum();
        let free = |r: &ShmRegion| !self.in_use.iter().any(|p| Path::new(p) == r.path);
        let i = match self
            .regions
            .iter()
            .position(|r| free(r) && r.map.len() as u64 >= total)
        {
            Some(i) => i,
            None => {
                // Too-small free regions go first, then the oldest free ones over the limit.
                self.regions
                    .retain(|r| !free(r) || r.map.len() as u64 >= total);
                while self.regions.len() >= MAX_REGIONS {
                    match self.regions.iter().position(free) {
                        Some(j) => drop(self.regions.remove(j)),
                        None => break,
                    }
                }
                self.regions.push(ShmRegion::create(total)?);
                self.regions.len() - 1
            }
        };
        let r = &mut self.regions[i];
        let crcs = r.write(params, manifest);
        Ok((r.path.to_string_lossy().into_owned(), crcs))
    }

    /// Records the receiver's acknowledgement: the regions it still reads.
    pub fn acknowledged(&mut self, in_use: Vec<String>) {
        self.in_use = in_use;
    }

    /// The regions' paths.
    pub fn paths(&self) -> Vec<&Path> {
        self.regions.iter().map(|r| r.path()).collect()
    }
}

/// A receiver's mappings of its senders' regions, kept across pushes (mapping a gigabyte
/// again costs page-table faults on every page).
#[derive(Default)]
pub struct ShmViews(Vec<(String, Arc<Mmap>)>);

impl ShmViews {
    /// The paths whose contents some snapshot still uses in place.
    pub fn in_use(&self) -> Vec<String> {
        self.0
            .iter()
            .filter(|(_, m)| Arc::strong_count(m) > 1)
            .map(|(p, _)| p.clone())
            .collect()
    }

    fn get(&mut self, path: &str) -> std::io::Result<Arc<Mmap>> {
        // Forget mappings nobody uses whose file is gone (the sender replaced the region).
        self.0
            .retain(|(p, m)| Arc::strong_count(m) > 1 || Path::new(p).exists());
        if let Some((_, m)) = self.0.iter().find(|(p, _)| p == path) {
            return Ok(m.clone());
        }
        let file = std::fs::File::open(path)?;
        // SAFETY: the sender writes a region only while no acknowledgement of ours lists it as
        // in use, and we only hand out views of it after its next write was acknowledged.
        let map = Arc::new(unsafe { memmap2::MmapOptions::new().populate().map(&file) }?);
        self.0.push((path.to_string(), map.clone()));
        Ok(map)
    }
}

/// Takes a snapshot that a sender on this host wrote into `path` with [`ShmPool::write`],
/// verifying every bucket's CRC-32C (buckets in parallel), and returns it with tensors that
/// are views of the mapped file: nothing is copied. Only files directly under [`SHM_DIR`] with
/// Trellis's prefix are opened. The acknowledgement lists the regions still in use, which
/// the caller should fill in after the actor took the snapshot (it may let an older one go).
pub fn read_shm(
    actor: &str,
    manifest: &SnapshotManifest,
    path: &str,
    crcs: &[u32],
    views: &mut ShmViews,
) -> Result<(WeightSnapshot, SnapshotAck), ActorError> {
    let bad = |message: String| ActorError::Snapshot {
        actor: actor.to_string(),
        message,
    };
    if !is_region(Path::new(path)) {
        return Err(bad(format!(
            "refusing to read {path}: not a Trellis snapshot under {SHM_DIR}"
        )));
    }
    // The manifest's checks (f32: its tensors are views of the file; sizes that add up),
    // without allocating anything.
    let offsets = check_manifest(actor, manifest, false)?;
    if crcs.len() != manifest.bucket_sizes.len() {
        return Err(bad(format!(
            "{} checksums for {} buckets",
            crcs.len(),
            manifest.bucket_sizes.len()
        )));
    }
    let map = views
        .get(path)
        .map_err(|e| bad(format!("cannot map {path}: {e}")))?;
    let total: u64 = manifest.bucket_sizes.iter().sum();
    if (map.len() as u64) < total {
        return Err(bad(format!(
            "{path} holds {} bytes; the manifest says {total}",
            map.len()
        )));
    }
    let bucket_bytes = manifest.bucket_sizes.first().copied().unwrap_or(1) as usize;
    let actual: Vec<u32> = map[..total as usize]
        .par_chunks(bucket_bytes)
        .map(proto::crc32c)
        .collect();
    for (i, (&a, &c)) in actual.iter().zip(crcs).enumerate() {
        if a != c {
            return Err(bad(format!(
                "bucket {i} in {path} is corrupted: CRC-32C {a:#010x}, sender said {c:#010x}"
            )));
        }
    }
    let tensors = manifest
        .tensors
        .iter()
        .zip(offsets)
        .map(|(t, offset)| {
            let data = Storage::mapped(map.clone(), offset as usize, (t.nbytes / 4) as usize)
                .ok_or_else(|| bad(format!("tensor `{}` lies outside {path}", t.name)))?;
            Ok(Tensor {
                name: t.name.clone(),
                shape: t.shape.iter().map(|&d| d as usize).collect(),
                data,
            })
        })
        .collect::<Result<Vec<_>, ActorError>>()?;
    let ack = SnapshotAck {
        version: manifest.version,
        bytes: total,
        digest: digest(crcs),
        shm_in_use: Vec::new(),
    };
    let snapshot = WeightSnapshot::new(manifest.version, Arc::new(TensorSet { tensors }));
    Ok((snapshot, ack))
}

#[cfg(test)]
mod shm_sweep_tests {
    use super::*;

    #[test]
    fn a_sweep_removes_the_files_of_dead_senders_and_keeps_live_ones() {
        let dir = std::env::temp_dir().join(format!("trellis-shm-sweep-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // A live sender's file: open with its shared lock held.
        let live = dir.join(format!("{SHM_PREFIX}1-0"));
        let held = std::fs::File::create(&live).unwrap();
        assert!(lock(&held, libc::LOCK_SH));
        // A killed sender's: nobody holds it.
        let dead = dir.join(format!("{SHM_PREFIX}2-0"));
        std::fs::write(&dead, b"x").unwrap();
        let other = dir.join("someone-else");
        std::fs::write(&other, b"x").unwrap();
        // A file being made (its maker not yet locked it) is kept; one left by a maker killed
        // long ago is removed.
        let making = dir.join(format!("{SHM_NEW_PREFIX}3-0"));
        std::fs::write(&making, b"x").unwrap();
        let left = dir.join(format!("{SHM_NEW_PREFIX}4-0"));
        let old = std::time::SystemTime::now() - 2 * SHM_NEW_STALE;
        std::fs::File::create(&left)
            .and_then(|f| f.set_modified(old))
            .unwrap();
        remove_dead_processes_files(&dir);
        assert!(live.exists() && other.exists() && making.exists());
        assert!(!dead.exists() && !left.exists());
        drop(held);
        remove_dead_processes_files(&dir);
        assert!(!live.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A region is locked before it has the name a sweep looks for: a sweep in another
    /// process, however it interleaves with the making, never removes a live region.
    #[test]
    fn a_region_is_never_swept_while_it_is_made() {
        let dir = std::env::temp_dir().join(format!("trellis-shm-make-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sweeper = {
            let (dir, stop) = (dir.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    remove_dead_processes_files(&dir);
                }
            })
        };
        for _ in 0..5000 {
            let region = ShmRegion::create_in(&dir, 4096).unwrap();
            assert!(region.path().exists(), "{}", region.path().display());
            assert!(
                !dir.read_dir()
                    .unwrap()
                    .flatten()
                    .any(|e| { e.file_name().to_string_lossy().starts_with(SHM_NEW_PREFIX) })
            );
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        sweeper.join().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(s: &WeightSnapshot, bucket_bytes: usize) -> SnapshotManifest {
        super::manifest(s.version, s.params().unwrap(), bucket_bytes)
    }

    fn manifest_as(
        s: &WeightSnapshot,
        bucket_bytes: usize,
        bf16: Option<&[bool]>,
    ) -> SnapshotManifest {
        super::manifest_as(s.version, s.params().unwrap(), bucket_bytes, bf16)
    }

    fn bucket(s: &WeightSnapshot, m: &SnapshotManifest, index: usize) -> (Vec<u8>, u32) {
        super::bucket(s.params().unwrap(), m, index)
    }

    fn snapshot() -> WeightSnapshot {
        let tensor = |name: &str, shape: Vec<usize>, seed: f32| Tensor {
            name: name.into(),
            data: (0..shape.iter().product::<usize>())
                .map(|i| seed + i as f32 * 0.5)
                .collect(),
            shape,
        };
        WeightSnapshot::new(
            9,
            Arc::new(TensorSet {
                tensors: vec![
                    tensor("a", vec![3, 5], 1.0),
                    tensor("b", vec![7], -2.0),
                    tensor("c", vec![2, 2, 2], 0.25),
                ],
            }),
        )
    }

    fn send(s: &WeightSnapshot, bucket_bytes: usize) -> (WeightSnapshot, SnapshotAck, u32) {
        let m = manifest(s, bucket_bytes);
        let mut asm =
            Assembler::new("t", &m, 1 << 20, &mut Spares::default()).expect("manifest is valid");
        let mut crcs = Vec::new();
        for i in 0..m.bucket_sizes.len() {
            let (b, crc) = bucket(s, &m, i);
            assert_eq!(crc, proto::crc32c(&b));
            crcs.push(crc);
            asm.push(i as u32, &b, crc).expect("bucket is accepted");
        }
        let (back, ack) = asm.finish().expect("complete");
        (back, ack, digest(&crcs))
    }

    #[test]
    fn round_trips_for_any_bucket_size_including_tensors_spanning_buckets() {
        let s = snapshot();
        for bucket_bytes in [1, 3, 4, 13, 60, 64, 1 << 20] {
            let (back, ack, expect) = send(&s, bucket_bytes);
            assert_eq!(
                *back.params().unwrap(),
                *s.params().unwrap(),
                "bucket_bytes = {bucket_bytes}"
            );
            assert_eq!(back.version, 9);
            assert_eq!(ack.digest, expect);
            assert_eq!(ack.bytes, (15 + 7 + 8) * 4);
            assert_eq!(
                content_crc(back.params().unwrap()),
                content_crc(s.params().unwrap())
            );
        }
    }

    /// Tensors marked bf16 (with an even number of values) travel as two bytes a value and
    /// arrive as the f32 of their bf16 rounding; the others, and a marked one of odd length,
    /// arrive exactly — for every bucket size (rounded up to whole words), through both the
    /// reference bucket and the encoder's bytes.
    #[test]
    fn bf16_tensors_travel_at_half_the_bytes_and_arrive_rounded() {
        let tensor = |name: &str, shape: Vec<usize>, seed: f32| Tensor {
            name: name.into(),
            data: (0..shape.iter().product::<usize>())
                .map(|i| seed + i as f32 * 0.123_457)
                .collect(),
            shape,
        };
        let s = WeightSnapshot::new(
            4,
            Arc::new(TensorSet {
                tensors: vec![
                    tensor("w", vec![4, 6], 1.0),
                    tensor("norm", vec![5], -2.0),
                    tensor("v", vec![3, 4], 0.3),
                    tensor("odd", vec![3], 7.0),
                ],
            }),
        );
        let marks = [true, false, true, true];
        let want: Vec<Vec<f32>> = s
            .params()
            .unwrap()
            .tensors
            .iter()
            .zip(marks)
            .map(|(t, m)| match m && t.data.len() % 2 == 0 {
                true => kernels::bf16::rounded(&t.data),
                false => t.data.to_vec(),
            })
            .collect();
        for bucket_bytes in [1, 3, 4, 13, 60, 1 << 20] {
            let m = manifest_as(&s, bucket_bytes, Some(&marks));
            let total: u64 = m.bucket_sizes.iter().sum();
            assert_eq!(total, 24 * 2 + 5 * 4 + 12 * 2 + 3 * 4, "{bucket_bytes}");
            let dtypes: Vec<Dtype> = m.tensors.iter().map(|t| t.dtype()).collect();
            assert_eq!(dtypes, [Dtype::Bf16, Dtype::F32, Dtype::Bf16, Dtype::F32]);
            let mut asm = Assembler::new("t", &m, 1 << 20, &mut Spares::default()).unwrap();
            let (starts, bf16) = (starts(&m.tensors), narrowed(&m.tensors));
            let mut at = 0;
            for (i, &len) in m.bucket_sizes.iter().enumerate() {
                assert!(
                    i + 1 == m.bucket_sizes.len() || len % 4 == 0,
                    "{bucket_bytes}"
                );
                let (b, crc) = bucket(&s, &m, i);
                let mut encoded = Vec::new();
                let crc2 = gather_into(
                    s.params().unwrap(),
                    &starts,
                    &bf16,
                    at,
                    len as usize,
                    &mut encoded,
                );
                assert_eq!((&encoded, crc2), (&b, crc), "bucket {i} of {bucket_bytes}");
                asm.push(i as u32, &b, crc).unwrap();
                at += len;
            }
            let (back, _) = asm.finish().unwrap();
            for (t, w) in back.params().unwrap().tensors.iter().zip(&want) {
                assert_eq!(
                    &t.data[..],
                    &w[..],
                    "{} with buckets of {bucket_bytes}",
                    t.name
                );
            }
        }
        // Shared memory takes f32 only (its tensors are views of the file).
        let m = manifest_as(&s, 64, Some(&marks));
        let e = read_shm(
            "t",
            &m,
            "/dev/shm/trellis-snapshot-x",
            &[0; 3],
            &mut ShmViews::default(),
        )
        .expect_err("refused");
        assert!(e.to_string().contains("snapshots carry f32 here"), "{e}");
        let mut odd = m.clone();
        odd.bucket_sizes = vec![2, total_of(&m) - 2];
        let e = Assembler::new("t", &odd, 1 << 20, &mut Spares::default())
            .err()
            .expect("refused");
        assert!(e.to_string().contains("whole 4-byte words"), "{e}");
    }

    fn total_of(m: &SnapshotManifest) -> u64 {
        m.bucket_sizes.iter().sum()
    }

    #[test]
    fn corrupted_reordered_short_and_missing_buckets_are_refused() {
        let s = snapshot();
        let m = manifest(&s, 32);
        let (b0, _) = bucket(&s, &m, 0);
        let mut asm =
            Assembler::new("rollout-0", &m, 1 << 20, &mut Spares::default()).expect("valid");
        let mut flipped = b0.clone();
        flipped[5] ^= 1;
        let e = asm.push(0, &flipped, proto::crc32c(&b0)).unwrap_err();
        assert!(e.to_string().contains("bucket 0 arrived corrupted"), "{e}");
        let e = asm.push(1, &b0, proto::crc32c(&b0)).unwrap_err();
        assert!(e.to_string().contains("where bucket 0 was expected"), "{e}");
        let e = asm
            .push(0, &b0[..10], proto::crc32c(&b0[..10]))
            .unwrap_err();
        assert!(
            e.to_string().contains("has 10 bytes; the manifest says 32"),
            "{e}"
        );
        asm.push(0, &b0, proto::crc32c(&b0)).expect("good bucket");
        let e = asm.finish().unwrap_err();
        assert!(e.to_string().contains("after 1 of 4 buckets"), "{e}");
        assert!(e.to_string().contains("rollout-0"), "{e}");
    }

    #[test]
    fn inconsistent_manifests_are_refused() {
        let s = snapshot();
        let mut m = manifest(&s, 32);
        m.tensors[1].shape = vec![8];
        let e = Assembler::new("t", &m, 1 << 20, &mut Spares::default())
            .err()
            .expect("refused");
        assert!(
            e.to_string()
                .contains("tensor `b` has shape [8] but 28 bytes"),
            "{e}"
        );
        let mut m = manifest(&s, 32);
        m.bucket_sizes.pop();
        let e = Assembler::new("t", &m, 1 << 20, &mut Spares::default())
            .err()
            .expect("refused");
        assert!(e.to_string().contains("buckets hold"), "{e}");
        let m = manifest(&s, 64);
        let e = Assembler::new("t", &m, 16, &mut Spares::default())
            .err()
            .expect("refused");
        assert!(e.to_string().contains("exceeds the limit of 16"), "{e}");
    }

    #[test]
    fn shared_memory_snapshots_are_used_in_place_and_regions_alternate() {
        let s = snapshot();
        let m = manifest(&s, 24);
        let (mut pool, mut views) = (ShmPool::default(), ShmViews::default());
        let (path, crcs) = pool
            .write(s.params().unwrap(), &m)
            .expect("/dev/shm is writable");
        let (back, mut ack) = read_shm("t", &m, &path, &crcs, &mut views).expect("reads back");
        assert_eq!(*back.params().unwrap(), *s.params().unwrap());
        assert_eq!(ack.digest, digest(&crcs));
        assert!(
            back.params()
                .unwrap()
                .tensors
                .iter()
                .all(|t| t.data.mapping().is_some()),
            "the tensors are views of the region, not copies"
        );
        ack.shm_in_use = views.in_use();
        assert_eq!(ack.shm_in_use, vec![path.clone()]);
        pool.acknowledged(ack.shm_in_use);
        // The next version cannot go where the receiver still reads version 9.
        let mut next = (**s.params().unwrap()).clone();
        next.tensors[1].data[0] = 42.0;
        let s2 = WeightSnapshot::new(10, Arc::new(next));
        let (path2, crcs2) = pool.write(s2.params().unwrap(), &m).expect("writes");
        assert_ne!(path2, path, "a region in use is never rewritten");
        let (back2, _) = read_shm("t", &m, &path2, &crcs2, &mut views).expect("reads back");
        assert_eq!(back2.params().unwrap().tensors[1].data[0], 42.0);
        assert_eq!(
            *back.params().unwrap(),
            *s.params().unwrap(),
            "version 9 is untouched"
        );
        // A view written to is copied out first: the region is never written through.
        let mut copy = (**back2.params().unwrap()).clone();
        copy.tensors[0].data[0] = -1.0;
        assert!(copy.tensors[0].data.mapping().is_none());
        assert_eq!(
            back2.params().unwrap().tensors[0].data[0],
            s2.params().unwrap().tensors[0].data[0]
        );
        // Once version 9 is let go, its region takes version 11.
        drop(back);
        pool.acknowledged(views.in_use());
        let (path3, crcs3) = pool.write(s.params().unwrap(), &m).expect("writes");
        assert_eq!(path3, path, "the free region is reused");
        assert_eq!(pool.paths().len(), 2);
        let mut wrong = crcs3.clone();
        wrong[2] ^= 1;
        let e = read_shm("t", &m, &path3, &wrong, &mut views).unwrap_err();
        assert!(e.to_string().contains("bucket 2"), "{e}");
        let e = read_shm("t", &m, "/etc/passwd", &crcs, &mut views).unwrap_err();
        assert!(
            e.to_string().contains("refusing to read /etc/passwd"),
            "{e}"
        );
        drop(back2);
        drop(pool);
        assert!(!Path::new(&path).exists(), "the files are removed on drop");
        assert!(!Path::new(&path2).exists());
    }
}
