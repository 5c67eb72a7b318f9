//! The table of the connections being served, each on a thread of its own: how many there may
//! be at once, and which one gives way to a newcomer (Note [The control server]).

use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::session::Watch;
use super::sys::Tracked;

/// The connections being served.
pub struct Table {
    max: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    next_id: u64,
    live: Vec<Entry>,
}

struct Entry {
    id: u64,
    stream: Arc<Tracked>,
    /// Since when the connection has waited for a request line; `None` while it serves one.
    idle_since: Option<Instant>,
    /// A line (the hello) has arrived: the client speaks the protocol.
    greeted: bool,
    /// Closed to make room: its thread is on its way out and no longer counts.
    evicted: bool,
}

impl Table {
    /// A table of at most `max` connections (at least one).
    pub fn new(max: usize) -> Arc<Table> {
        Arc::new(Table {
            max: max.max(1),
            inner: Mutex::default(),
        })
    }

    /// Take `stream` in. When the table is full, an idle connection (one waiting for a request
    /// line) is closed to make room: one that has not sent its hello yet if any, else the one
    /// that has waited longest. Its reading side is shut down, which wakes its thread; the
    /// thread sends it a `busy` error and ends. When every connection is serving a request,
    /// nothing gives way and `stream` is handed back, for a `busy` reply.
    pub fn admit(self: &Arc<Self>, stream: Tracked) -> Result<Ticket, Tracked> {
        let mut g = self.inner.lock();
        let counted = g.live.iter().filter(|e| !e.evicted).count();
        if counted >= self.max {
            let victim = g
                .live
                .iter_mut()
                .filter(|e| !e.evicted)
                .filter_map(|e| Some(((e.greeted, e.idle_since?), e)))
                .min_by_key(|(key, _)| *key)
                .map(|(_, e)| e);
            let Some(victim) = victim else {
                return Err(stream);
            };
            victim.evicted = true;
            if let Err(e) = victim.stream.shutdown(Shutdown::Read) {
                tracing::debug!("closing an idle control connection: {e}");
            }
        }
        let id = g.next_id;
        g.next_id += 1;
        let stream = Arc::new(stream);
        g.live.push(Entry {
            id,
            stream: Arc::clone(&stream),
            idle_since: Some(Instant::now()),
            greeted: false,
            evicted: false,
        });
        Ok(Ticket {
            table: Arc::clone(self),
            id,
            stream,
        })
    }

    /// Connections that count against the limit now.
    pub fn counted(&self) -> usize {
        self.inner.lock().live.iter().filter(|e| !e.evicted).count()
    }
}

/// A connection's place in the [`Table`], held by its thread; dropping it frees the place and
/// closes the connection (once nothing else holds the stream).
pub struct Ticket {
    table: Arc<Table>,
    id: u64,
    stream: Arc<Tracked>,
}

impl Ticket {
    /// The connection.
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    /// The connection, shared (to answer it should its thread not start).
    pub fn shared_stream(&self) -> Arc<Tracked> {
        Arc::clone(&self.stream)
    }

    fn with<T>(&self, f: impl FnOnce(&mut Entry) -> T) -> Option<T> {
        let mut g = self.table.inner.lock();
        g.live.iter_mut().find(|e| e.id == self.id).map(f)
    }
}

impl Watch for Ticket {
    fn idle(&self) {
        self.with(|e| e.idle_since = Some(Instant::now()));
    }

    fn working(&self) -> bool {
        self.with(|e| {
            if e.evicted {
                false
            } else {
                e.idle_since = None;
                e.greeted = true;
                true
            }
        })
        .unwrap_or(false)
    }

    fn evicted(&self) -> bool {
        self.with(|e| e.evicted).unwrap_or(true)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        // The connection closes when the last of its holders goes (the entry's here, this
        // ticket's just after), forgotten for fork children as it closes (`Tracked`).
        let entry = {
            let mut g = self.table.inner.lock();
            let i = g.live.iter().position(|e| e.id == self.id);
            i.map(|i| g.live.swap_remove(i))
        };
        drop(entry);
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;

    fn pair() -> (Tracked, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        (Tracked::new(a), b)
    }

    #[test]
    fn the_table_makes_room_from_idle_connections_only() {
        let t = Table::new(2);
        let (a, mut a_peer) = pair();
        let (b, _b_peer) = pair();
        let a = t.admit(a).ok().unwrap();
        let b = t.admit(b).ok().unwrap();
        assert_eq!(t.counted(), 2);
        // Both serving a request: nothing gives way.
        assert!(a.working() && b.working());
        let (c, _c_peer) = pair();
        assert!(t.admit(c).is_err());
        assert_eq!(t.counted(), 2);

        // a waits again: it gives way to d. Its reading side is shut, so its thread's read
        // ends at once; its client can still be told why.
        a.idle();
        let (d, _d_peer) = pair();
        let d = t.admit(d).ok().unwrap();
        assert!(a.evicted() && !a.working());
        assert!(!b.evicted() && !d.evicted());
        let mut buf = [0u8; 1];
        assert_eq!(a.stream().read(&mut buf).unwrap(), 0);
        super::super::sys::send_all(a.stream(), b"x", std::time::Duration::from_secs(2)).unwrap();
        assert_eq!(a_peer.read(&mut buf).unwrap(), 1);
        assert_eq!(t.counted(), 2);
        drop(a);
        assert_eq!(t.counted(), 2);

        // d has not said hello; b, idle for longer, has: d gives way.
        b.idle();
        std::thread::sleep(std::time::Duration::from_millis(5));
        let (e, _e_peer) = pair();
        let e = t.admit(e).ok().unwrap();
        assert!(d.evicted() && !b.evicted() && !e.evicted());
        drop((b, d, e));
        assert_eq!(t.counted(), 0);
    }
}
