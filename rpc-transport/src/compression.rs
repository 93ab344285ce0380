//! Payload compression: one payload (a call's parameters, an answer's result, later a stream
//! message) in, its compressed bytes out, and back, bounded.
//!
//! Large payloads of text-like data (JSON, MessagePack maps with repeated keys) cross a network
//! several times smaller compressed. What is compressed is chosen by the layer that knows the
//! service entry's options (the client for parameters, the server for results: see the
//! `compression` option); what arrives compressed is decompressed by the transport, which
//! knows the frame limit, before anyone looks at it. Everything here works on one payload at a
//! time, so any frame kind can reuse it: [`compress`] and [`decompress`], and [`pack`] for the
//! sender's whole rule (threshold, what the peer accepts, only when it pays).
//!
//! Decompression is bounded by a limit (the receiver's frame limit): a payload claiming or
//! producing more is refused before that much is allocated ([`CompressionError::TooLarge`]),
//! so a small frame cannot make a receiver allocate gigabytes. An LZ4 block claiming more than
//! it can expand to is refused before its buffer is made; a zstd frame that records no size
//! is decoded with a window of at least 8 MiB (what zstd's own streaming encoder may pick),
//! even under a smaller limit.

use std::cell::RefCell;
use std::io::Read;

use bytes::Bytes;
use rpc_core::Compression;

/// Zstandard level: 1, the fastest of the standard levels. A payload is compressed on the
/// caller's task (or the call's, on a server) once per call, so speed matters more than the
/// last percent of ratio.
pub const ZSTD_LEVEL: i32 = 1;

/// The most an LZ4 block expands: each further byte of a match's length stands for 255 bytes.
const LZ4_MAX_RATIO: usize = 255;

/// The algorithms this build can decode, in the order a handshake lists them.
pub const SUPPORTED: [Compression; 2] = [Compression::Zstd, Compression::Lz4];

/// The wire numbers of [`SUPPORTED`], as a handshake lists them (`accept_compression`).
pub fn supported_wire() -> Vec<i32> {
    SUPPORTED.iter().map(|c| c.to_wire()).collect()
}

/// Why a payload could not be decompressed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompressionError {
    /// The message names an algorithm this build does not know.
    #[error("the payload is compressed with algorithm {0}, which this side does not know (it accepts 1 = zstd, 2 = lz4); send it with an algorithm the handshake listed")]
    Unknown(i32),
    /// The payload does not decompress with the algorithm its message names.
    #[error("the payload does not decompress as {algorithm}: {reason}; the sender's compressed bytes are corrupt")]
    Corrupt {
        /// The algorithm the message named.
        algorithm: Compression,
        /// What the decoder said.
        reason: String,
    },
    /// The payload decompresses (or says it decompresses) to more than the limit.
    #[error("the payload decompresses to {size} bytes or more, above the limit of {limit} bytes (the receiver's frame limit); send smaller payloads or raise the limit")]
    TooLarge {
        /// The size found (for a payload that does not say its size: the limit plus one).
        size: u64,
        /// The limit.
        limit: usize,
    },
}

thread_local! {
    /// One zstd compression context per thread: making one allocates about a megabyte of
    /// tables at level 1, which would otherwise be paid on every payload.
    static ZSTD_COMPRESSOR: RefCell<Option<zstd::bulk::Compressor<'static>>> =
        const { RefCell::new(None) };
    /// One zstd decompression context per thread, for the same reason.
    static ZSTD_DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { RefCell::new(None) };
}

/// `data` compressed with `algorithm` ([`Compression::Off`]: a copy of it). Zstandard writes
/// one frame that records its decompressed size; LZ4 one block preceded by its decompressed
/// size (4 bytes, little-endian), as `proto/rpc.proto` describes.
pub fn compress(algorithm: Compression, data: &[u8]) -> Bytes {
    match algorithm {
        Compression::Off => Bytes::copy_from_slice(data),
        Compression::Lz4 => lz4_flex::block::compress_prepend_size(data).into(),
        Compression::Zstd => ZSTD_COMPRESSOR.with(|c| {
            let mut c = c.borrow_mut();
            let compressed = match c.as_mut() {
                Some(c) => c.compress(data),
                None => zstd::bulk::Compressor::new(ZSTD_LEVEL).and_then(|mut new| {
                    let out = new.compress(data);
                    *c = Some(new);
                    out
                }),
            };
            // zstd fails only when it cannot allocate its context or output: try the one-shot
            // function, and when that fails too, panic as any allocation failure would (an
            // empty payload marked zstd would reach the peer as a silently empty value).
            compressed
                .or_else(|_| zstd::bulk::compress(data, ZSTD_LEVEL))
                .unwrap_or_else(|e| panic!("zstd could not compress {} bytes: {e}", data.len()))
                .into()
        }),
    }
}

/// The size `data` says it decompresses to, read from its header without decompressing it
/// (an LZ4 block's size prefix, the content sizes of zstd frames that record theirs); `None`
/// when it does not say, or is not of a known algorithm. [`decompress`] checks it again.
pub(crate) fn declared_size(algorithm: i32, data: &[u8]) -> Option<usize> {
    match Compression::from_wire(algorithm)? {
        Compression::Off => Some(data.len()),
        Compression::Lz4 => lz4_flex::block::uncompressed_size(data)
            .ok()
            .map(|(size, _)| size),
        Compression::Zstd => zstd::bulk::Decompressor::upper_bound(data),
    }
}

/// `data`, compressed with `algorithm` (a wire number, as a message's `compression` field
/// holds it), decompressed; at most `limit` bytes come out, or it is an error. Numbers 0 (none)
/// hand `data` back as it is.
pub fn decompress(algorithm: i32, data: &Bytes, limit: usize) -> Result<Bytes, CompressionError> {
    let Some(algorithm) = Compression::from_wire(algorithm) else {
        return Err(CompressionError::Unknown(algorithm));
    };
    let corrupt = |reason: String| CompressionError::Corrupt { algorithm, reason };
    match algorithm {
        Compression::Off => Ok(data.clone()),
        Compression::Lz4 => {
            let (size, block) = lz4_flex::block::uncompressed_size(data)
                .map_err(|e| corrupt(format!("no size before the block ({e})")))?;
            if size > limit {
                return Err(CompressionError::TooLarge {
                    size: size as u64,
                    limit,
                });
            }
            // An LZ4 block expands at most about 255 times (a byte of a match's length stands
            // for 255 more): a size beyond that is a lie, refused before its buffer is made.
            if size > block.len().saturating_mul(LZ4_MAX_RATIO).saturating_add(64) {
                return Err(corrupt(format!(
                    "its size says {size} bytes, more than a block of {} bytes can hold",
                    block.len()
                )));
            }
            let mut out = vec![0; size];
            let n = lz4_flex::block::decompress_into(block, &mut out)
                .map_err(|e| corrupt(e.to_string()))?;
            if n != size {
                return Err(corrupt(format!(
                    "the block holds {n} bytes, its size says {size}"
                )));
            }
            Ok(out.into())
        }
        Compression::Zstd => {
            // Frames that record their size (every frame `compress` writes) are decompressed
            // in one call into a buffer of exactly that size, once the size is checked; a
            // payload whose frames do not all say it is read through a stream, a chunk at a
            // time, up to the limit.
            match zstd::bulk::Decompressor::upper_bound(data) {
                Some(size) if size > limit => Err(CompressionError::TooLarge {
                    size: size as u64,
                    limit,
                }),
                Some(_) => ZSTD_DECOMPRESSOR.with(|d| {
                    let mut d = d.borrow_mut();
                    let d = match d.as_mut() {
                        Some(d) => d,
                        None => d.insert(
                            zstd::bulk::Decompressor::new()
                                .map_err(|e| corrupt(format!("no decoder: {e}")))?,
                        ),
                    };
                    d.decompress(data, limit)
                        .map(Bytes::from)
                        .map_err(|e| corrupt(e.to_string()))
                }),
                None => {
                    let mut decoder = zstd::stream::read::Decoder::with_buffer(&data[..])
                        .map_err(|e| corrupt(e.to_string()))?;
                    // The decoder allocates the window a frame declares, up to 128 MiB by
                    // default, however little the frame holds: no more than the limit needs
                    // (or what a streaming encoder picks at any level but the `--ultra` ones).
                    let window_log = stream_window_log(limit);
                    decoder
                        .window_log_max(window_log)
                        .map_err(|e| corrupt(e.to_string()))?;
                    let mut out = Vec::new();
                    decoder
                        .take((limit as u64).saturating_add(1))
                        .read_to_end(&mut out)
                        .map_err(|e| {
                            if e.to_string().contains("too much memory") {
                                corrupt(format!(
                                    "a frame's window is over the {} bytes this side decodes \
                                     with (for a limit of {limit} bytes): compress with a \
                                     smaller window, or record the size in the frame",
                                    1u64 << window_log
                                ))
                            } else {
                                corrupt(e.to_string())
                            }
                        })?;
                    if out.len() > limit {
                        return Err(CompressionError::TooLarge {
                            size: out.len() as u64,
                            limit,
                        });
                    }
                    Ok(out.into())
                }
            }
        }
    }
}

/// The largest window (log2 of its bytes) a zstd frame without a recorded size may declare for
/// a payload of at most `limit` bytes: what the limit needs, and never less than 8 MiB (2^23, the
/// largest window zstd's streaming encoder picks at levels 1 to 19).
fn stream_window_log(limit: usize) -> u32 {
    let needed = usize::BITS - limit.saturating_sub(1).leading_zeros();
    needed.clamp(23, 31)
}

/// The algorithms a peer listed in its handshake, as a set. `Copy`, one byte.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Accepted(u8);

impl Accepted {
    /// A peer that listed nothing (or predates compression).
    pub const NONE: Accepted = Accepted(0);

    /// Every algorithm this build decodes ([`SUPPORTED`]).
    pub const SUPPORTED: Accepted = Accepted((1 << 1) | (1 << 2));

    /// The set of a handshake's `accept_compression` list; numbers this build does not know
    /// are left out.
    pub fn from_wire(list: &[i32]) -> Accepted {
        Accepted(
            list.iter()
                .filter(|&&n| (1..=2).contains(&n))
                .fold(0, |set, &n| set | (1 << n)),
        )
    }

    /// Whether the peer can decode `algorithm` (never for [`Compression::Off`], which needs
    /// no decoding).
    pub fn contains(self, algorithm: Compression) -> bool {
        algorithm != Compression::Off && self.0 & (1 << algorithm.to_wire()) != 0
    }
}

/// What a sender does with one payload: compressed with `algorithm` when the peer `accepts`
/// it, the payload is at least `threshold` bytes, and the result is smaller; `None` when it
/// goes plain.
pub fn pack(
    algorithm: Compression,
    threshold: usize,
    accepts: Accepted,
    data: &[u8],
) -> Option<Bytes> {
    if data.len() < threshold || !accepts.contains(algorithm) {
        return None;
    }
    let packed = compress(algorithm, data);
    (packed.len() < data.len()).then_some(packed)
}

/// The payload of an item of stream `message_id` compressed with `compression` (wire number,
/// 0: plain), decompressed within `limit` bytes.
pub(crate) fn unpack_payload(
    message_id: u64,
    payload: &bytes::Bytes,
    compression: i32,
    limit: usize,
) -> Result<bytes::Bytes, String> {
    if compression == 0 {
        return Ok(payload.clone());
    }
    decompress(compression, payload, limit).map_err(|e| format!("stream item {message_id}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A JSON-like, compressible payload of `n` bytes.
    fn text(n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n);
        let mut i = 0u64;
        while out.len() < n {
            out.extend_from_slice(
                format!("{{\"id\":{i},\"name\":\"item {i}\",\"tags\":[\"a\",\"b\"]}},").as_bytes(),
            );
            i += 1;
        }
        out.truncate(n);
        out
    }

    /// An LZ4 size prefix that claims more than its block can hold is refused before a buffer
    /// of that size is made; the most compressible payload there is still comes back whole.
    #[test]
    fn an_lz4_size_beyond_what_its_block_can_hold_is_refused() {
        let lie = Bytes::from_static(&[0xff, 0xff, 0xff, 0x00, 0x00]);
        match decompress(Compression::Lz4.to_wire(), &lie, 64 << 20) {
            Err(CompressionError::Corrupt { reason, .. }) => {
                assert!(reason.contains("16777215 bytes"), "{reason}")
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        let zeros = vec![0u8; 4 << 20];
        let packed = compress(Compression::Lz4, &zeros);
        let back = decompress(Compression::Lz4.to_wire(), &packed, 8 << 20).expect("whole");
        assert_eq!(back.len(), zeros.len());
    }

    #[test]
    fn both_algorithms_round_trip_and_shrink_text() {
        let data = text(64 * 1024);
        for alg in SUPPORTED {
            let packed = compress(alg, &data);
            assert!(
                packed.len() * 4 < data.len(),
                "{alg}: {} bytes",
                packed.len()
            );
            let back = decompress(alg.to_wire(), &packed, data.len()).unwrap();
            assert_eq!(&back[..], &data[..], "{alg}");
        }
        // Empty payloads too.
        for alg in SUPPORTED {
            let back = decompress(alg.to_wire(), &compress(alg, b""), 0).unwrap();
            assert!(back.is_empty());
        }
    }

    #[test]
    fn the_lz4_format_is_the_size_then_one_block() {
        let data = text(1000);
        let packed = compress(Compression::Lz4, &data);
        assert_eq!(&packed[..4], &1000u32.to_le_bytes());
        // Another LZ4 block decoder reads the rest.
        assert_eq!(
            lz4_flex::block::decompress(&packed[4..], 1000).unwrap(),
            data
        );
    }

    #[test]
    fn more_than_the_limit_is_refused_by_size_before_decoding() {
        let data = text(10_000);
        for alg in SUPPORTED {
            let e = decompress(alg.to_wire(), &compress(alg, &data), 9_999).unwrap_err();
            assert_eq!(
                e,
                CompressionError::TooLarge {
                    size: 10_000,
                    limit: 9_999
                },
                "{alg}"
            );
        }
        // An LZ4 size prefix claiming 4 GiB is refused without allocating it.
        let lie = Bytes::from(vec![0xff, 0xff, 0xff, 0xff, 0x00]);
        assert!(matches!(
            decompress(2, &lie, 1 << 20),
            Err(CompressionError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_zstd_stream_without_a_size_is_bounded_while_reading() {
        let data = text(100_000);
        // A streaming encoder does not record the size in the frame.
        let mut enc = zstd::stream::write::Encoder::new(Vec::new(), 1).unwrap();
        std::io::Write::write_all(&mut enc, &data).unwrap();
        let stream = Bytes::from(enc.finish().unwrap());
        assert_eq!(zstd::bulk::Decompressor::upper_bound(&stream), None);
        assert_eq!(&decompress(1, &stream, 100_000).unwrap()[..], &data[..]);
        assert!(matches!(
            decompress(1, &stream, 50_000),
            Err(CompressionError::TooLarge { size: 50_001, .. })
        ));
        // No limit at all (`usize::MAX`, which a side may configure): the bound does not
        // overflow into a read of nothing.
        assert_eq!(&decompress(1, &stream, usize::MAX).unwrap()[..], &data[..]);
    }

    /// A frame without a recorded size declaring a huge window is refused before the decoder
    /// allocates it, however little it holds.
    #[test]
    fn a_zstd_stream_declaring_a_window_over_the_limit_is_refused() {
        let mut enc = zstd::stream::write::Encoder::new(Vec::new(), 1).unwrap();
        enc.window_log(27).unwrap();
        std::io::Write::write_all(&mut enc, b"tiny").unwrap();
        let stream = Bytes::from(enc.finish().unwrap());
        assert_eq!(zstd::bulk::Decompressor::upper_bound(&stream), None);
        match decompress(1, &stream, 1 << 20) {
            Err(CompressionError::Corrupt { reason, .. }) => {
                assert!(reason.contains("window"), "{reason}")
            }
            other => panic!("a 128 MiB window for 4 bytes was taken: {other:?}"),
        }
        // Within the limit, the same frame is read.
        assert_eq!(&decompress(1, &stream, 1 << 27).unwrap()[..], b"tiny");
    }

    #[test]
    fn the_stream_window_follows_the_limit_above_8_mib() {
        assert_eq!(stream_window_log(1), 23);
        assert_eq!(stream_window_log(1 << 23), 23);
        assert_eq!(stream_window_log((1 << 24) + 1), 25);
        assert_eq!(stream_window_log(1 << 24), 24);
        assert_eq!(stream_window_log(usize::MAX), 31);
    }

    #[test]
    fn corrupt_and_unknown_payloads_are_typed_errors() {
        let data = text(5_000);
        for alg in SUPPORTED {
            let mut packed = compress(alg, &data).to_vec();
            // Cut the payload short: neither decoder can finish it.
            packed.truncate(packed.len() / 2);
            let e = decompress(alg.to_wire(), &Bytes::from(packed), 1 << 20).unwrap_err();
            assert!(
                matches!(e, CompressionError::Corrupt { algorithm, .. } if algorithm == alg),
                "{alg}: {e:?}"
            );
        }
        let garbage = Bytes::from_static(b"not compressed at all");
        assert!(matches!(
            decompress(1, &garbage, 1 << 20),
            Err(CompressionError::Corrupt { .. })
        ));
        assert_eq!(
            decompress(9, &garbage, 1 << 20),
            Err(CompressionError::Unknown(9))
        );
        assert_eq!(&decompress(0, &garbage, 0).unwrap()[..], &garbage[..]);
    }

    #[test]
    fn pack_applies_the_threshold_the_peer_and_the_gain() {
        let data = text(2_000);
        let all = Accepted::from_wire(&supported_wire());
        assert_eq!(all, Accepted::SUPPORTED);
        assert!(pack(Compression::Zstd, 2_000, all, &data).is_some());
        assert!(
            pack(Compression::Zstd, 2_001, all, &data).is_none(),
            "below"
        );
        assert!(pack(Compression::Off, 0, all, &data).is_none());
        let only_lz4 = Accepted::from_wire(&[2, 7]);
        assert!(pack(Compression::Zstd, 0, only_lz4, &data).is_none());
        assert!(pack(Compression::Lz4, 0, only_lz4, &data).is_some());
        assert!(pack(Compression::Lz4, 0, Accepted::NONE, &data).is_none());
        // Random bytes do not shrink: they go plain.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let noise: Vec<u8> = (0..4096)
            .map(|_| {
                // xorshift64
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 32) as u8
            })
            .collect();
        assert!(pack(Compression::Lz4, 0, all, &noise).is_none());
    }
}
