//! `tmsctl list`: the processes with a control socket, in tmsctl's folder and (unless that
//! folder was named) elsewhere, with their memory; the sockets of other pid namespaces too.

use std::time::Duration;

use serde_json::{json, Value};

use crate::client::Client;
use crate::ctx::Ctx;
use crate::failure::Failure;
use crate::find;
use crate::ops::status_of;
use crate::output::{human, print_json};
use crate::procfs::command_line;
use crate::socket::{Ns, Socket};
use crate::text::{one_line, printable, shown_path};

/// `tmsctl list`.
pub fn run(ctx: &Ctx) -> anyhow::Result<()> {
    let found = find::listing(ctx)?;
    // The live processes of our pid namespace, those that /proc shows listening in other
    // folders (with why, where their socket cannot be used), then the sockets of other pid
    // namespaces: asked for their status too, their servers checked as far as they can be from
    // here (uid and hello; their pids mean other processes here, so neither whether they live nor
    // the kernel's pid of the server says anything, and their command lines cannot be read).
    let mut socks: Vec<(Socket, Option<Failure>)> = found
        .main
        .live_here()
        .into_iter()
        .map(|s| (s, None))
        .collect();
    for a in &found.away {
        socks.push((a.socket(), a.sock.as_ref().err().cloned()));
    }
    socks.extend(found.main.elsewhere().into_iter().map(|s| (s, None)));
    let mut rows = Vec::new();
    for (sock, unusable) in socks {
        let command = match sock.ns {
            Ns::Other(_) => "?".to_string(),
            _ => command_line(sock.pid()),
        };
        let t = ctx.timeout.min(Duration::from_secs(5));
        let r = match unusable {
            Some(e) => Err(e),
            None => Client::connect(&sock, t).and_then(|mut c| status_of(&mut c)),
        };
        rows.push((sock, command, r));
    }
    if ctx.json {
        let items: Vec<Value> = rows
            .iter()
            .map(|(sock, command, r)| {
                let mut j = match r {
                    Ok(s) => json!({
                        "pid": sock.pid(), "command": command, "backend": s.backend,
                        "tags": s.tags.len(), "bytes_active": s.bytes_active(),
                        "bytes_paused": s.bytes_paused(),
                    }),
                    Err(e) => json!({"pid": sock.pid(), "command": command, "error": e.message}),
                };
                j["socket"] = json!(sock.path.to_string_lossy());
                j["pidns"] = json!(sock.name.pidns);
                j["this_pid_namespace"] = json!(sock.here());
                j
            })
            .collect();
        print_json(Value::Array(items));
        return Ok(());
    }
    if rows.is_empty() {
        say!(
            "{}",
            one_line(&find::none_found(ctx, &found.main, &[]).message)
        );
        return Ok(());
    }
    say!(
        "{:<8} {:<8} {:>5} {:>12} {:>12}  COMMAND",
        "PID",
        "BACKEND",
        "TAGS",
        "ACTIVE",
        "PAUSED"
    );
    let mut notes = Vec::new();
    for (sock, command, r) in rows {
        let mut command: String = command.chars().take(100).collect();
        if let Ns::Other(ns) = sock.ns {
            command = format!("(pid {} of pid namespace {ns}, not this one)", sock.pid());
        }
        if let Some(d) = sock.path.parent().filter(|d| *d != found.main.dir) {
            notes.push(format!("pid {} listens in {}", sock.pid(), shown_path(d)));
        }
        match r {
            Ok(s) => say!(
                "{:<8} {:<8} {:>5} {:>12} {:>12}  {command}",
                sock.pid(),
                printable(&s.backend),
                s.tags.len(),
                human(s.bytes_active()),
                human(s.bytes_paused())
            ),
            Err(e) => say!(
                "{:<8} {:<8} {:>5} {:>12} {:>12}  {command}  ({})",
                sock.pid(),
                "-",
                "-",
                "-",
                "-",
                one_line(&e.message)
            ),
        }
    }
    if !notes.is_empty() {
        say!(
            "\n{}, not in {} ({}): their TMS_SOCKET_DIR or XDG_RUNTIME_DIR differ from tmsctl's",
            notes.join(", "),
            shown_path(&found.main.dir),
            ctx.origin.about()
        );
    }
    Ok(())
}
