//! Wire types of the Torch Memory Saver control protocol: line-delimited JSON over a Unix
//! socket. This crate holds the types and limits only; no I/O policy.

/// Protocol version; a client and server agree on it in the hello exchange.
pub const PROTOCOL_VERSION: u32 = 1;

/// Longest line (request or reply) either side accepts, in bytes.
pub const MAX_LINE_BYTES: usize = 64 * 1024;
