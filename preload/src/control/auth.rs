//! Who may talk to the server: only processes of the server's own (effective) uid, as the
//! kernel recorded it at `connect` (`SO_PEERCRED`). The check is made once per connection and
//! its result is a type: only an [`AuthenticatedClient`] can issue requests (the session code
//! takes one), so no path serves a connection that was not checked.
//!
//! The socket's folder (0700) and file (0600) already keep other users out; this check also
//! covers what file modes cannot: root (which ignores them) and a socket reached through an
//! inherited descriptor.

use std::fmt;
use std::os::unix::net::UnixStream;

use super::sys;
pub use super::sys::PeerCred;

/// Why a connection is refused.
#[derive(Debug)]
pub enum AuthError {
    /// The peer runs as another user.
    OtherUser {
        /// The peer's uid.
        peer: u32,
        /// Ours.
        server: u32,
    },
    /// The kernel did not tell us who the peer is.
    NoCredentials(std::io::Error),
}

impl fmt::Display for AuthError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AuthError::OtherUser { peer, server } => write!(
                f,
                "permission denied: the client runs as uid {peer}, this process as uid {server}; \
                 only the same user may control it"
            ),
            AuthError::NoCredentials(e) => {
                write!(
                    f,
                    "permission denied: cannot read the client's credentials: {e}"
                )
            }
        }
    }
}

/// The credential rule: the peer's uid must be the server's (root gets no exception).
pub fn check(cred: PeerCred, server_uid: u32) -> Result<PeerCred, AuthError> {
    if cred.uid == server_uid {
        Ok(cred)
    } else {
        Err(AuthError::OtherUser {
            peer: cred.uid,
            server: server_uid,
        })
    }
}

/// A connection whose peer passed [`check`]. Constructed only by [`authenticate`].
pub struct AuthenticatedClient<'a> {
    stream: &'a UnixStream,
    cred: PeerCred,
}

impl<'a> AuthenticatedClient<'a> {
    /// The connection.
    pub fn stream(&self) -> &'a UnixStream {
        self.stream
    }

    /// Who is on the other end.
    pub fn cred(&self) -> PeerCred {
        self.cred
    }
}

/// Check the peer of `stream` against `server_uid`.
pub fn authenticate(
    stream: &UnixStream,
    server_uid: u32,
) -> Result<AuthenticatedClient<'_>, AuthError> {
    let cred = sys::peer_cred(stream).map_err(AuthError::NoCredentials)?;
    let cred = check(cred, server_uid)?;
    Ok(AuthenticatedClient { stream, cred })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cred(uid: u32) -> PeerCred {
        PeerCred {
            pid: 10,
            uid,
            gid: uid,
        }
    }

    #[test]
    fn same_uid_passes_others_do_not() {
        assert_eq!(check(cred(1000), 1000).unwrap(), cred(1000));
        for (peer, server) in [(1001, 1000), (0, 1000), (1000, 0), (65534, 0)] {
            let e = check(cred(peer), server).unwrap_err();
            let m = e.to_string();
            assert!(m.starts_with("permission denied"), "{m}");
            assert!(
                m.contains(&format!("uid {peer}")) && m.contains(&format!("uid {server}")),
                "{m}"
            );
        }
    }

    #[test]
    fn authenticate_a_local_pair() {
        let (a, _b) = UnixStream::pair().unwrap();
        let c = authenticate(&a, sys::euid()).unwrap();
        assert_eq!(c.cred().uid, sys::euid());
        assert!(matches!(
            authenticate(&a, sys::euid().wrapping_add(1)),
            Err(AuthError::OtherUser { .. })
        ));
    }
}
