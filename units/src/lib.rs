//! Quantities as Torch Memory Saver writes and reads them, shared by `libtms.so` (its settings,
//! its messages, its control server) and `tmsctl`:
//!
//! - byte sizes ([`bytes`]): `512MiB` read, `1.50 GiB` written;
//! - runs of chunk indices ([`runs`]): the inclusive ranges the control protocol carries
//!   (`[[8,15],[20,20]]`, its `ChunkRanges`) and the lists people type (`8-15,20`);
//! - why one of them does not parse ([`ParseError`]).
//!
//! Pure functions, no I/O: the wire types stay in `tms_proto`.

pub mod bytes;
mod error;
pub mod runs;

pub use bytes::{human_bytes, parse_bytes, scaled_bytes};
pub use error::{ListFault, ParseError};
pub use runs::{
    chunk_ranges, expand_chunk_ranges, format_chunk_ranges, format_ranges, parse_ranges,
};

#[cfg(test)]
mod tests {
    use super::*;

    /// The messages, word for word as they were when these were plain strings.
    #[test]
    fn each_error_keeps_its_message() {
        let msg = |e: ParseError| e.to_string();
        assert_eq!(
            msg(parse_bytes(" 1.5G").unwrap_err()),
            "\" 1.5G\" is not a byte size (examples: 1048576, 512MiB, 8GiB)"
        );
        assert_eq!(
            msg(expand_chunk_ranges(&[[5, 2]], 10).unwrap_err()),
            "chunk range 5-2 runs backwards"
        );
        assert_eq!(
            msg(expand_chunk_ranges(&[[0, 10]], 10).unwrap_err()),
            "more than 10 chunks asked for"
        );
        let cases = [
            ("1,,2", "empty item"),
            ("x", "\"x\" is not an index"),
            ("5-2", "range 5-2 runs backwards"),
            ("0-10", "more than 10 chunks"),
        ];
        for (text, why) in cases {
            assert_eq!(
                msg(parse_ranges(text, 10).unwrap_err()),
                format!("chunk list {text:?}: {why} (expected e.g. 8-15,20)")
            );
        }
        // Only where usize is narrower than u64.
        assert_eq!(
            msg(ParseError::ChunkOutOfRange { chunk: 1 << 40 }),
            "chunk 1099511627776 is out of range"
        );
    }
}
