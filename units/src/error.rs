//! Why a value does not parse: a byte count, a chunk list as `tmsctl --chunks` takes it, or
//! chunk ranges off the wire. Each message names the value and what is wrong with it.

use std::fmt;

/// A value that cannot be taken.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ParseError {
    /// Not a byte count ([`parse_bytes`](crate::parse_bytes)).
    ByteSize {
        /// The text given.
        text: String,
    },
    /// A chunk range on the wire whose last chunk comes before its first.
    RangeBackwards {
        /// Its first chunk.
        first: u64,
        /// Its last chunk.
        last: u64,
    },
    /// More chunks than allowed, counted before duplicates go.
    TooManyChunks {
        /// The most allowed.
        limit: usize,
    },
    /// A chunk index past what this machine can address.
    ChunkOutOfRange {
        /// The index.
        chunk: u64,
    },
    /// A chunk list in text ([`parse_ranges`](crate::parse_ranges)).
    ChunkList {
        /// The text given.
        text: String,
        /// What is wrong with it.
        fault: ListFault,
    },
}

/// What is wrong with a chunk list in text.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ListFault {
    /// Nothing between two commas (or no text at all).
    EmptyItem,
    /// An item that is not an index.
    NotAnIndex {
        /// The item.
        item: String,
    },
    /// A range whose end comes before its start.
    Backwards {
        /// Its start.
        first: usize,
        /// Its end.
        last: usize,
    },
    /// More chunks than allowed.
    TooMany {
        /// The most allowed.
        limit: usize,
    },
    /// Whitespace in the list (it is written as `format_ranges` writes it).
    Whitespace,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParseError::ByteSize { text } => write!(
                f,
                "{text:?} is not a byte size (examples: 1048576, 512MiB, 8GiB)"
            ),
            ParseError::RangeBackwards { first, last } => {
                write!(f, "chunk range {first}-{last} runs backwards")
            }
            ParseError::TooManyChunks { limit } => write!(f, "more than {limit} chunks asked for"),
            ParseError::ChunkOutOfRange { chunk } => write!(f, "chunk {chunk} is out of range"),
            ParseError::ChunkList { text, fault } => {
                write!(f, "chunk list {text:?}: {fault} (expected e.g. 8-15,20)")
            }
        }
    }
}

impl fmt::Display for ListFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListFault::EmptyItem => f.write_str("empty item"),
            ListFault::NotAnIndex { item } => write!(f, "{item:?} is not an index"),
            ListFault::Backwards { first, last } => {
                write!(f, "range {first}-{last} runs backwards")
            }
            ListFault::TooMany { limit } => write!(f, "more than {limit} chunks"),
            ListFault::Whitespace => f.write_str("whitespace is not allowed"),
        }
    }
}

impl std::error::Error for ParseError {}
