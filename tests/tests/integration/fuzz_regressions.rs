//! The fuzz corpus as a regression suite: every committed input of the cargo-fuzz targets
//! (`fuzz/corpus/{frame_decoder,frame,params}/`) goes through the same checks the fuzzer runs
//! (`fuzz/src/lib.rs`, compiled in here), so a change that breaks one fails the normal tests.
//! Inputs worth pinning down on their own are inlined below with the typed error they give.
//!
//! `cargo test -p tests --test integration fuzz_regressions:: -- --ignored` rewrites the seed inputs
//! (`seed-*`) of the corpus from real frames and argument lists.

#[path = "../../../fuzz/src/lib.rs"]
mod fuzz_checks;

use std::path::{Path, PathBuf};

use bytes::BytesMut;
use fuzz_checks::{frame, frame_decoder, params};
use rpc_transport::{FrameCodec, FrameError};
use tokio_util::codec::Decoder;

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/corpus")).join(target)
}

/// Runs `check` on every file of the target's corpus, naming the file that fails.
fn replay(target: &str, check: fn(&[u8])) {
    let dir = corpus_dir(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no corpus in {}", dir.display());
    for file in files {
        let data = std::fs::read(&file).expect("a corpus file");
        if std::panic::catch_unwind(|| check(&data)).is_err() {
            panic!("{} fails the `{target}` checks", file.display());
        }
    }
}

#[test]
fn frame_decoder_corpus() {
    replay("frame_decoder", frame_decoder::check);
}

#[test]
fn frame_corpus() {
    replay("frame", frame::check);
}

#[test]
fn params_corpus() {
    replay("params", params::check);
}

#[test]
fn seeds_pass_the_checks() {
    for (_, data) in frame_decoder::seeds() {
        frame_decoder::check(&data);
    }
    for (_, data) in frame::seeds() {
        frame::check(&data);
    }
    for (_, data) in params::seeds() {
        params::check(&data);
    }
}

/// Feeds `bytes` one at a time, returning the first error and how many bytes it took.
fn first_error_bytewise(max: usize, bytes: &[u8]) -> (FrameError, usize) {
    let mut codec = FrameCodec::new(max);
    let mut buf = BytesMut::new();
    for (i, byte) in bytes.iter().enumerate() {
        buf.extend_from_slice(&[*byte]);
        loop {
            match codec.decode(&mut buf) {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => return (e, i + 1),
            }
        }
    }
    panic!("no error from {bytes:?}");
}

#[test]
fn too_large_prefix_is_refused_at_its_fourth_byte() {
    // Ping { nonce: 0 }, then a prefix of 64 KiB + 1 and payload bytes never waited for.
    let stream = [
        0, 0, 0, 2, 0x32, 0x00, // Ping { nonce: 0 }
        0x00, 0x01, 0x00, 0x01, b'x', b'y', b'z',
    ];
    match first_error_bytewise(64 * 1024, &stream) {
        (
            FrameError::TooLarge {
                len: 65_537,
                max: 65_536,
            },
            10,
        ) => {}
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn frame_of_exactly_the_maximum_is_accepted() {
    // GoAway { status_code: 200 }: 5 bytes of Frame.
    let bytes = [0, 0, 0, 5, 0x42, 0x03, 0x08, 0xc8, 0x01];
    let mut codec = FrameCodec::new(5);
    let mut buf = BytesMut::from(&bytes[..]);
    assert!(matches!(codec.decode(&mut buf), Ok(Some(_))));
    let mut codec = FrameCodec::new(4);
    let mut buf = BytesMut::from(&bytes[..]);
    assert!(matches!(
        codec.decode(&mut buf),
        Err(FrameError::TooLarge { len: 5, max: 4 })
    ));
}

/// A group (wire type 3 or 4), in a frame or in its message, is refused where prost would
/// step over it; the target's plain reading of the format refuses it too, whatever the
/// chunking. A lone group key that prost finds malformed is refused as a group all the same.
#[test]
fn a_group_is_refused_as_the_format_says() {
    // An empty group (field 13), then a Ping; then a StreamItems whose message opens with an
    // empty group (field 7); then a lone start-group key.
    for (stream, field) in [
        (&[0, 0, 0, 4, 0x6b, 0x6c, 0x32, 0x00][..], 13),
        (&[0, 0, 0, 6, 0x62, 0x04, 0x3b, 0x3c, 0x08, 0x01][..], 7),
        (&[0, 0, 0, 1, 0x0b][..], 1),
    ] {
        match first_error_bytewise(1024, stream) {
            (FrameError::Group { field: f }, _) => assert_eq!(f, field, "{stream:?}"),
            other => panic!("{stream:?}: {other:?}"),
        }
        for chunks in [&[][..], &[0][..], &[2, 0][..]] {
            frame_decoder::check(&frame_decoder::input(false, chunks, stream));
        }
    }
}

#[test]
fn truncated_and_empty_payloads_are_typed_errors() {
    // A Hello whose token announces 100 bytes but the frame holds 2.
    let truncated = [0, 0, 0, 6, 0x0a, 0x04, 0x12, 0x64, b'a', b'b'];
    assert!(matches!(
        first_error_bytewise(1024, &truncated).0,
        FrameError::Malformed(_)
    ));
    // A Frame holding only an unknown field (number 100, varint): valid protobuf, no message.
    let unknown = [0, 0, 0, 3, 0xa0, 0x06, 0x01];
    assert!(matches!(
        first_error_bytewise(1024, &unknown).0,
        FrameError::Empty
    ));
}

#[test]
fn hostile_parameters_are_errors() {
    use rpc_core::Codec;
    // A MessagePack array32 announcing 4 billion strings, and a str32 announcing 4 GiB.
    let huge_array = [0xdd, 0xff, 0xff, 0xff, 0xff, 0xa1, b'x'];
    assert!(Codec::MsgPack.decode::<Vec<String>>(&huge_array).is_err());
    let huge_str = [0x91, 0xdb, 0xff, 0xff, 0xff, 0xff, b'x'];
    assert!(Codec::MsgPack.decode::<(String,)>(&huge_str).is_err());
}

/// Arguments nested 1 000 arrays deep (within rmp-serde's default limit of 1 024) aborted a
/// debug-built server with a stack overflow on a 2 MiB tokio worker stack: MessagePack decoding
/// recursed once per level into the ignored trailing arguments of a method without arguments,
/// or into an unknown field of a struct argument. MessagePack now stops at 128 levels (JSON's
/// limit); JSON skips ignored values without recursing.
#[test]
fn deeply_nested_parameters_are_refused_on_a_worker_stack() {
    use rpc_core::{Codec, NoArgs};
    const TOKIO_WORKER_STACK: usize = 2 * 1024 * 1024;
    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Profile {
        id: u64,
    }
    let decode = || {
        // [[[...]]], 1 000 levels.
        let mut arrays = vec![0x91; 999];
        arrays.push(0x90);
        let err = Codec::MsgPack.decode::<NoArgs>(&arrays).unwrap_err();
        assert!(err.to_string().contains("depth limit exceeded"), "{err}");
        // [{"id": 1, "x": [[[...]]]}]
        let mut unknown_field = vec![0x91, 0x82, 0xa2, b'i', b'd', 0x01, 0xa1, b'x'];
        unknown_field.extend(&arrays);
        let err = Codec::MsgPack
            .decode::<(Profile,)>(&unknown_field)
            .unwrap_err();
        assert!(err.to_string().contains("depth limit exceeded"), "{err}");

        let nested = format!("{}{}", "[".repeat(1000), "]".repeat(1000));
        let (profile,) = Codec::Json
            .decode::<(Profile,)>(format!(r#"[{{"id": 1, "x": {nested}}}]"#).as_bytes())
            .expect("JSON skips an unknown field iteratively");
        assert_eq!(profile.id, 1);
        let err = Codec::Json
            .decode::<(Vec<serde_json::Value>,)>(format!("[{nested}]").as_bytes())
            .unwrap_err();
        assert!(
            err.to_string().contains("recursion limit exceeded"),
            "{err}"
        );
    };
    std::thread::Builder::new()
        .stack_size(TOKIO_WORKER_STACK)
        .spawn(decode)
        .expect("spawn a thread")
        .join()
        .expect("decoding refused the nesting without overflowing the stack");
}

#[test]
#[ignore = "writes the seed corpus into fuzz/corpus"]
fn write_seed_corpus() {
    let write = |target: &str, name: &str, data: &[u8]| {
        let dir = corpus_dir(target);
        std::fs::create_dir_all(&dir).expect("create the corpus directory");
        std::fs::write(dir.join(name), data).expect("write a seed");
    };
    for (name, data) in frame_decoder::seeds() {
        write("frame_decoder", name, &data);
    }
    for (name, data) in frame::seeds() {
        write("frame", &name, &data);
    }
    for (name, data) in params::seeds() {
        write("params", &name, &data);
    }
}
