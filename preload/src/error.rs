//! One error type for the whole engine. Every variant carries a human-readable context
//! (call, device, tag, pointer, sizes) so the message alone tells what failed and where.

use std::fmt::Display;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong. The C ABI maps each variant to a stable status code
/// (see [`Error::status`]); the Python shim maps those to exception classes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Device (or host) memory ran out. Recoverable: free something and retry.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// A driver call failed with something other than out-of-memory.
    #[error("{call} failed with {name} ({code}): {context}")]
    Driver {
        /// The driver entry point, e.g. `cuMemMap`.
        call: &'static str,
        /// The driver's numeric status.
        code: i32,
        /// The driver's symbolic name for `code`, e.g. `CUDA_ERROR_INVALID_VALUE`.
        name: String,
        /// Where it happened.
        context: String,
    },
    /// The caller passed something that cannot be right.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The call is not valid in the current state.
    #[error("invalid state: {0}")]
    InvalidState(String),
    /// The address or tag named is not known.
    #[error("not found: {0}")]
    NotFound(String),
    /// Not available with this driver or build.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A failure kept from an earlier call (the library's start-up), with its original status.
    #[error("{message}")]
    Sticky {
        /// The original status code.
        status: i32,
        /// The original message.
        message: String,
    },
    /// A bug inside the library (a panic caught inside it); the process carries on.
    #[error("internal error (a bug in torch-memory-saver): {0}")]
    Internal(String),
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        /// Where it happened.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Stable status codes of the C ABI. Never renumber: the Python shim and C callers depend on them.
pub mod status {
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

    /// Short symbolic name of a status code.
    pub fn name(code: i32) -> &'static str {
        match code {
            OK => "TMS_OK",
            OUT_OF_MEMORY => "TMS_ERR_OUT_OF_MEMORY",
            DRIVER => "TMS_ERR_DRIVER",
            INVALID_ARGUMENT => "TMS_ERR_INVALID_ARGUMENT",
            INVALID_STATE => "TMS_ERR_INVALID_STATE",
            NOT_FOUND => "TMS_ERR_NOT_FOUND",
            UNSUPPORTED => "TMS_ERR_UNSUPPORTED",
            IO => "TMS_ERR_IO",
            INTERNAL => "TMS_ERR_INTERNAL",
            BUFFER_TOO_SMALL => "TMS_ERR_BUFFER_TOO_SMALL",
            _ => "TMS_ERR_UNKNOWN_STATUS",
        }
    }
}

impl Error {
    /// The C ABI status code for this error.
    pub fn status(&self) -> i32 {
        match self {
            Error::OutOfMemory(_) => status::OUT_OF_MEMORY,
            Error::Driver { .. } => status::DRIVER,
            Error::InvalidArgument(_) => status::INVALID_ARGUMENT,
            Error::InvalidState(_) => status::INVALID_STATE,
            Error::NotFound(_) => status::NOT_FOUND,
            Error::Unsupported(_) => status::UNSUPPORTED,
            Error::Io { .. } => status::IO,
            Error::Internal(_) => status::INTERNAL,
            Error::Sticky { status, .. } => *status,
        }
    }

    /// True for out-of-memory, the one recoverable failure.
    pub fn is_oom(&self) -> bool {
        self.status() == status::OUT_OF_MEMORY
    }

    /// Prefix the context with where the caller was (`"pause tag 'kv'"`, ...).
    pub fn context(self, outer: impl Display) -> Self {
        let join = |inner: String| {
            if inner.is_empty() {
                outer.to_string()
            } else {
                format!("{outer}: {inner}")
            }
        };
        match self {
            Error::OutOfMemory(s) => Error::OutOfMemory(join(s)),
            Error::Driver {
                call,
                code,
                name,
                context,
            } => Error::Driver {
                call,
                code,
                name,
                context: join(context),
            },
            Error::InvalidArgument(s) => Error::InvalidArgument(join(s)),
            Error::InvalidState(s) => Error::InvalidState(join(s)),
            Error::NotFound(s) => Error::NotFound(join(s)),
            Error::Unsupported(s) => Error::Unsupported(join(s)),
            Error::Io { context, source } => Error::Io {
                context: join(context),
                source,
            },
            Error::Sticky { status, message } => Error::Sticky {
                status,
                message: join(message),
            },
            Error::Internal(s) => Error::Internal(join(s)),
        }
    }

    /// The error of the last OS call, with context.
    pub fn last_os(context: impl Display) -> Self {
        Error::Io {
            context: context.to_string(),
            source: std::io::Error::last_os_error(),
        }
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
        let e = Error::Driver {
            call: "cuMemMap",
            code: 1,
            name: "CUDA_ERROR_INVALID_VALUE".into(),
            context: "ptr 0x1000 size 2097152".into(),
        }
        .context("alloc on device 0")
        .context("resume tag 'kv'");
        assert_eq!(
            e.to_string(),
            "cuMemMap failed with CUDA_ERROR_INVALID_VALUE (1): resume tag 'kv': alloc on device 0: ptr 0x1000 size 2097152"
        );
        assert_eq!(e.status(), status::DRIVER);
    }

    #[test]
    fn status_names_are_distinct() {
        let names: std::collections::HashSet<_> = (0..=9).map(status::name).collect();
        assert_eq!(names.len(), 10);
        assert_eq!(status::name(42), "TMS_ERR_UNKNOWN_STATUS");
    }
}
