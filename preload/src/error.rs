//! One error type for the whole engine: a kind (what went wrong, which decides the C ABI status)
//! and a human-readable context (call, device, tag, pointer, sizes) so the message alone tells
//! what failed and where. Code branches on the kind, never on the message.

use std::fmt::{self, Display};

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong. The C ABI maps each kind to a stable status code ([`ErrorKind::status`]);
/// the Python shim maps those to exception classes ([`status::TABLE`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Device (or host) memory ran out. Recoverable: free something and retry.
    OutOfMemory,
    /// A driver call failed with something other than out-of-memory.
    Driver {
        /// The driver entry point, e.g. `cuMemMap`.
        call: &'static str,
        /// The driver's numeric status.
        code: i32,
        /// The driver's symbolic name for `code`, e.g. `CUDA_ERROR_INVALID_VALUE`.
        name: String,
    },
    /// The caller passed something that cannot be right.
    InvalidArgument,
    /// The call is not valid in the current state.
    InvalidState,
    /// The address or tag named is not known.
    NotFound,
    /// Not available with this driver or build.
    Unsupported,
    /// An operating-system call failed (the OS error, when there is one, is the source).
    Io,
    /// A bug inside the library (a panic caught inside it); the process carries on.
    Internal,
    /// The caller's output buffer is too small for the `needed` bytes (the NUL included).
    BufferTooSmall {
        /// Bytes the output needs.
        needed: usize,
    },
    /// A failure kept from an earlier call (the library's start-up), with its original status;
    /// the context is the original message.
    Sticky {
        /// The original status code.
        status: i32,
    },
}

impl ErrorKind {
    /// The C ABI status code of this kind.
    pub fn status(&self) -> i32 {
        match self {
            ErrorKind::OutOfMemory => status::OUT_OF_MEMORY,
            ErrorKind::Driver { .. } => status::DRIVER,
            ErrorKind::InvalidArgument => status::INVALID_ARGUMENT,
            ErrorKind::InvalidState => status::INVALID_STATE,
            ErrorKind::NotFound => status::NOT_FOUND,
            ErrorKind::Unsupported => status::UNSUPPORTED,
            ErrorKind::Io => status::IO,
            ErrorKind::Internal => status::INTERNAL,
            ErrorKind::BufferTooSmall { .. } => status::BUFFER_TOO_SMALL,
            ErrorKind::Sticky { status } => *status,
        }
    }
}

/// An error: its [`ErrorKind`], where it happened (the context, outermost first), for an OS
/// failure the OS error, and for a pause or resume what it changed all the same ([`Changed`]).
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    context: String,
    source: Option<std::io::Error>,
    /// Boxed: most errors have none, and every `Result` of the crate carries the room.
    changed: Option<Box<Changed>>,
}

/// What a pause or resume that failed changed all the same and left so, as the engine saw it:
/// the allocations whose segments (chunks) are not mapped as they were before it (paused, or
/// resumed), the device bytes of those segments, and NCCL's communicators it left suspended or
/// resumed. A client undoing a job's operation asks it rather than guessing from the state,
/// which the program may have changed meanwhile.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Changed {
    /// Allocations whose state differs from before.
    pub allocations: usize,
    /// Device bytes of their segments that differ.
    pub bytes: u64,
    /// NCCL communicators suspended or resumed.
    pub communicators: usize,
}

impl Changed {
    /// Nothing changed.
    pub const NOTHING: Changed = Changed {
        allocations: 0,
        bytes: 0,
        communicators: 0,
    };

    /// Whether nothing changed.
    pub fn is_nothing(&self) -> bool {
        *self == Changed::NOTHING
    }

    /// What two steps of one call changed together (its memory's and its communicators').
    pub fn plus(self, o: Changed) -> Changed {
        Changed {
            allocations: self.allocations + o.allocations,
            bytes: self.bytes + o.bytes,
            communicators: self.communicators + o.communicators,
        }
    }
}

/// Stable status codes of the C ABI, and [`TABLE`], the one list of them: `tms.h` and the
/// Python exceptions are checked against it (`tests/tests/header.rs`). Never renumber: the
/// Python shim and C callers depend on them.
pub mod status {
    use std::ffi::CStr;

    /// Success.
    pub const OK: i32 = 0;
    /// Out of memory (device or host); the state is unchanged and the call may be retried.
    pub const OUT_OF_MEMORY: i32 = 1;
    /// A driver call failed.
    pub const DRIVER: i32 = 2;
    /// Bad argument.
    pub const INVALID_ARGUMENT: i32 = 3;
    /// Not valid in the current state.
    pub const INVALID_STATE: i32 = 4;
    /// Unknown address or tag.
    pub const NOT_FOUND: i32 = 5;
    /// Not supported here.
    pub const UNSUPPORTED: i32 = 6;
    /// Operating-system error.
    pub const IO: i32 = 7;
    /// A bug inside the library (a caught panic); the process carries on.
    pub const INTERNAL: i32 = 8;
    /// The caller's output buffer is too small; the needed size was reported.
    pub const BUFFER_TOO_SMALL: i32 = 9;

    /// One status code of the C ABI.
    #[derive(Clone, Copy, Debug)]
    pub struct Status {
        /// The code.
        pub code: i32,
        /// Its symbolic name, as `tms.h` defines it (`TMS_ERR_DRIVER`).
        pub symbol: &'static CStr,
        /// The exception class `torch_memory_saver.errors` raises for it (`None` for success).
        pub python: Option<&'static str>,
        /// What it means: `tms.h`'s comment above its `#define`.
        pub meaning: &'static str,
    }

    impl Status {
        /// The symbolic name as a `str`.
        pub const fn name(&self) -> &'static str {
            as_str(self.symbol)
        }
    }

    const fn as_str(c: &'static CStr) -> &'static str {
        match c.to_str() {
            Ok(s) => s,
            // Every name here is ASCII (a test checks).
            Err(_) => "",
        }
    }

    /// Every status code, in code order (a test checks the order).
    pub const TABLE: [Status; 10] = [
        Status {
            code: OK,
            symbol: c"TMS_OK",
            python: None,
            meaning: "Success.",
        },
        Status {
            code: OUT_OF_MEMORY,
            symbol: c"TMS_ERR_OUT_OF_MEMORY",
            python: Some("OutOfMemoryError"),
            meaning: "Out of memory (device or host); the state is unchanged and the call may \
                      be retried.",
        },
        Status {
            code: DRIVER,
            symbol: c"TMS_ERR_DRIVER",
            python: Some("DriverError"),
            meaning: "A CUDA or HIP driver call failed (the message names the call and its error).",
        },
        Status {
            code: INVALID_ARGUMENT,
            symbol: c"TMS_ERR_INVALID_ARGUMENT",
            python: Some("InvalidArgumentError"),
            meaning: "Bad argument (NULL where a value is required, empty tag, malformed \
                      setting, ...).",
        },
        Status {
            code: INVALID_STATE,
            symbol: c"TMS_ERR_INVALID_STATE",
            python: Some("InvalidStateError"),
            meaning: "Not valid in the current state (region exit without enter, forked \
                      child, ...).",
        },
        Status {
            code: NOT_FOUND,
            symbol: c"TMS_ERR_NOT_FOUND",
            python: Some("NotFoundError"),
            meaning: "Unknown address or tag.",
        },
        Status {
            code: UNSUPPORTED,
            symbol: c"TMS_ERR_UNSUPPORTED",
            python: Some("UnsupportedError"),
            meaning: "Not supported with this driver or build.",
        },
        Status {
            code: IO,
            symbol: c"TMS_ERR_IO",
            python: Some("TorchMemorySaverError"),
            meaning: "An operating-system call failed.",
        },
        Status {
            code: INTERNAL,
            symbol: c"TMS_ERR_INTERNAL",
            python: Some("InternalError"),
            meaning: "A bug inside the library (a caught panic); the process carries on.",
        },
        Status {
            code: BUFFER_TOO_SMALL,
            symbol: c"TMS_ERR_BUFFER_TOO_SMALL",
            // The package sizes its buffers: a bug if seen.
            python: Some("InternalError"),
            meaning: "The caller's output buffer is too small; the needed length was reported \
                      in *out_len.",
        },
    ];

    /// The name of a code outside [`TABLE`].
    pub const UNKNOWN: &CStr = c"TMS_ERR_UNKNOWN_STATUS";

    /// The entry of `code`, if it is one.
    pub fn lookup(code: i32) -> Option<&'static Status> {
        TABLE.iter().find(|s| s.code == code)
    }

    /// Symbolic name of a status code, NUL-terminated ([`UNKNOWN`] for an unknown code).
    pub fn c_name(code: i32) -> &'static CStr {
        lookup(code).map_or(UNKNOWN, |s| s.symbol)
    }

    /// Short symbolic name of a status code.
    pub fn name(code: i32) -> &'static str {
        as_str(c_name(code))
    }
}

impl Error {
    /// An error of `kind` with `context`.
    pub fn new(kind: ErrorKind, context: impl Into<String>) -> Self {
        Error {
            kind,
            context: context.into(),
            source: None,
            changed: None,
        }
    }

    /// Device or host memory ran out.
    pub fn out_of_memory(context: impl Into<String>) -> Self {
        Error::new(ErrorKind::OutOfMemory, context)
    }

    /// Driver call `call` failed with status `code`, named `name`.
    pub fn driver(
        call: &'static str,
        code: i32,
        name: impl Into<String>,
        context: impl Into<String>,
    ) -> Self {
        let name = name.into();
        Error::new(ErrorKind::Driver { call, code, name }, context)
    }

    /// The caller passed something that cannot be right.
    pub fn invalid_argument(context: impl Into<String>) -> Self {
        Error::new(ErrorKind::InvalidArgument, context)
    }

    /// Not valid in the current state.
    pub fn invalid_state(context: impl Into<String>) -> Self {
        Error::new(ErrorKind::InvalidState, context)
    }

    /// Unknown address or tag.
    pub fn not_found(context: impl Into<String>) -> Self {
        Error::new(ErrorKind::NotFound, context)
    }

    /// Not available with this driver or build.
    pub fn unsupported(context: impl Into<String>) -> Self {
        Error::new(ErrorKind::Unsupported, context)
    }

    /// A bug inside the library.
    pub fn internal(context: impl Into<String>) -> Self {
        Error::new(ErrorKind::Internal, context)
    }

    /// An OS call failed with `source`.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error {
            source: Some(source),
            ..Error::new(ErrorKind::Io, context)
        }
    }

    /// The error of the last OS call, with context.
    pub fn last_os(context: impl Display) -> Self {
        Error::io(context.to_string(), std::io::Error::last_os_error())
    }

    /// An output of `needed` bytes does not fit the caller's buffer of `cap` bytes.
    pub fn buffer_too_small(cap: usize, needed: usize) -> Self {
        Error::new(
            ErrorKind::BufferTooSmall { needed },
            format!("output buffer of {cap} bytes is too small for {needed} bytes"),
        )
    }

    /// No output buffer (NULL) was given, as to ask how large one must be: `needed` bytes.
    pub fn no_buffer(needed: usize) -> Self {
        Error::new(
            ErrorKind::BufferTooSmall { needed },
            format!("no output buffer (NULL) given; it needs {needed} bytes"),
        )
    }

    /// A failure kept from an earlier call: its status and its whole message.
    pub fn sticky(status: i32, message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Sticky { status }, message)
    }

    /// A copy, for one failure reported in several places (an I/O source keeps its kind and
    /// message).
    pub fn duplicate(&self) -> Error {
        Error {
            kind: self.kind.clone(),
            context: self.context.clone(),
            source: self
                .source
                .as_ref()
                .map(|s| std::io::Error::new(s.kind(), s.to_string())),
            changed: self.changed.clone(),
        }
    }

    /// A failed pause or resume that changed `c` all the same (in place of what it said
    /// before: an earlier operation's failure it reports is about that one's changes).
    pub fn with_changed(mut self, c: Changed) -> Self {
        self.changed = Some(Box::new(c));
        self
    }

    /// A failure before anything was changed.
    pub fn unchanged(self) -> Self {
        self.with_changed(Changed::NOTHING)
    }

    /// What the failed pause or resume changed all the same; `None` where it does not say.
    pub fn changed(&self) -> Option<Changed> {
        self.changed.as_deref().copied()
    }

    /// What went wrong.
    pub fn kind(&self) -> &ErrorKind {
        &self.kind
    }

    /// The C ABI status code for this error.
    pub fn status(&self) -> i32 {
        self.kind.status()
    }

    /// True for out-of-memory, the one recoverable failure.
    pub fn is_oom(&self) -> bool {
        self.status() == status::OUT_OF_MEMORY
    }

    /// Add what happened after the failure (`"... ; what was undone"`) to the context.
    pub fn note(mut self, after: impl Display) -> Self {
        self.context = format!("{}; {after}", self.context);
        self
    }

    /// Prefix the context with where the caller was (`"pause tag 'kv'"`, ...).
    pub fn context(mut self, outer: impl Display) -> Self {
        self.context = if self.context.is_empty() {
            outer.to_string()
        } else {
            format!("{outer}: {}", self.context)
        };
        self
    }
}

impl Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.context;
        match &self.kind {
            ErrorKind::OutOfMemory => write!(f, "out of memory: {c}"),
            ErrorKind::Driver { call, code, name } => {
                write!(f, "{call} failed with {name} ({code}): {c}")
            }
            ErrorKind::InvalidArgument => write!(f, "invalid argument: {c}"),
            ErrorKind::InvalidState => write!(f, "invalid state: {c}"),
            ErrorKind::NotFound => write!(f, "not found: {c}"),
            ErrorKind::Unsupported => write!(f, "unsupported: {c}"),
            ErrorKind::Internal => write!(f, "internal error (a bug in torch-memory-saver): {c}"),
            ErrorKind::Io => match &self.source {
                Some(s) => write!(f, "{c}: {s}"),
                None => f.write_str(c),
            },
            ErrorKind::BufferTooSmall { .. } | ErrorKind::Sticky { .. } => f.write_str(c),
        }
    }
}

/// A value that does not parse (a byte count, chunk ranges) is an invalid argument.
impl From<tms_units::ParseError> for Error {
    fn from(e: tms_units::ParseError) -> Self {
        Error::invalid_argument(e.to_string())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_ref().map(|e| e as _)
    }
}

/// Extension to add context to a `Result`.
pub trait ResultExt<T> {
    /// Prefix the error's context lazily.
    fn ctx<D: Display>(self, f: impl FnOnce() -> D) -> Result<T>;
}

impl<T> ResultExt<T> for Result<T> {
    fn ctx<D: Display>(self, f: impl FnOnce() -> D) -> Result<T> {
        self.map_err(|e| e.context(f()))
    }
}

/// The message of a caught panic's payload.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_nests_outermost_first() {
        let e = Error::driver(
            "cuMemMap",
            1,
            "CUDA_ERROR_INVALID_VALUE",
            "ptr 0x1000 size 2097152",
        )
        .context("alloc on device 0")
        .context("resume tag 'kv'");
        assert_eq!(
            e.to_string(),
            "cuMemMap failed with CUDA_ERROR_INVALID_VALUE (1): resume tag 'kv': alloc on device 0: ptr 0x1000 size 2097152"
        );
        assert_eq!(e.status(), status::DRIVER);
    }

    /// Each kind's message, as the variants of the former enum wrote it, context included.
    #[test]
    fn every_kind_keeps_its_message_and_status() {
        let io = || std::io::Error::from_raw_os_error(libc::ENOSPC);
        let cases = [
            (
                Error::out_of_memory("d"),
                "out of memory: o: d",
                status::OUT_OF_MEMORY,
            ),
            (
                Error::driver("cuMemCreate", 999, "CUDA_ERROR_UNKNOWN", "d"),
                "cuMemCreate failed with CUDA_ERROR_UNKNOWN (999): o: d",
                status::DRIVER,
            ),
            (
                Error::invalid_argument("d"),
                "invalid argument: o: d",
                status::INVALID_ARGUMENT,
            ),
            (
                Error::invalid_state("d"),
                "invalid state: o: d",
                status::INVALID_STATE,
            ),
            (Error::not_found("d"), "not found: o: d", status::NOT_FOUND),
            (
                Error::unsupported("d"),
                "unsupported: o: d",
                status::UNSUPPORTED,
            ),
            (
                Error::internal("d"),
                "internal error (a bug in torch-memory-saver): o: d",
                status::INTERNAL,
            ),
            (Error::io("d", io()), &format!("o: d: {}", io()), status::IO),
            (Error::new(ErrorKind::Io, "d"), "o: d", status::IO),
            (
                Error::sticky(status::UNSUPPORTED, "d"),
                "o: d",
                status::UNSUPPORTED,
            ),
            (
                Error::buffer_too_small(2, 4),
                "o: output buffer of 2 bytes is too small for 4 bytes",
                status::BUFFER_TOO_SMALL,
            ),
        ];
        for (e, want, code) in cases {
            let e = e.context("o");
            assert_eq!(e.to_string(), want);
            assert_eq!(e.status(), code, "{e}");
            assert_eq!(e.is_oom(), code == status::OUT_OF_MEMORY, "{e}");
        }
        assert!(Error::sticky(status::OUT_OF_MEMORY, "m").is_oom());
    }

    #[test]
    fn empty_context_takes_the_outer_alone_and_the_os_error_is_the_source() {
        let e = Error::not_found("").context("tag 'kv'");
        assert_eq!(e.to_string(), "not found: tag 'kv'");
        let e = Error::io("open", std::io::Error::from_raw_os_error(libc::ENOENT));
        let src = std::error::Error::source(&e).map(ToString::to_string);
        assert_eq!(
            src,
            Some(std::io::Error::from_raw_os_error(libc::ENOENT).to_string())
        );
        assert!(std::error::Error::source(&Error::internal("x")).is_none());
        assert_eq!(
            Error::buffer_too_small(1, 7).kind(),
            &ErrorKind::BufferTooSmall { needed: 7 }
        );
    }

    #[test]
    fn the_status_table_is_in_code_order_with_distinct_ascii_names() {
        for (i, s) in status::TABLE.iter().enumerate() {
            assert_eq!(s.code, i as i32, "{s:?}");
            assert!(s.symbol.to_str().is_ok_and(|n| n.is_ascii()), "{s:?}");
            assert_eq!(status::name(s.code), s.name());
            assert!(s
                .name()
                .starts_with(if i == 0 { "TMS_OK" } else { "TMS_ERR_" }));
            assert_eq!(s.python.is_none(), s.code == status::OK, "{s:?}");
        }
        let names: std::collections::HashSet<_> = (0..=9).map(status::name).collect();
        assert_eq!(names.len(), 10);
        assert_eq!(status::name(42), "TMS_ERR_UNKNOWN_STATUS");
        assert_eq!(status::name(-1), "TMS_ERR_UNKNOWN_STATUS");
    }
}
