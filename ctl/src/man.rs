//! tmsctl's manual pages, made from its command-line definition: tmsctl(1) and one per command
//! (`tmsctl-pause(1)`), each with the exit codes as its EXIT STATUS. `docs/man/` holds them as
//! `tmsctl man --out-dir docs/man` writes them.

use std::path::Path;

use crate::cli::{Cli, EXIT_CODES};
use crate::failure::{Code, Failure};
use crate::text::shown_path;

/// tmsctl's command line as its manual pages describe it: the commands a user can run, and no
/// `help` command (clap adds one; each page already says what `--help` does). The version is
/// the plain one: the pages are checked in, and would otherwise change with every commit.
fn man_command() -> clap::Command {
    let mut cmd = <Cli as clap::CommandFactory>::command()
        .disable_help_subcommand(true)
        .version(env!("CARGO_PKG_VERSION"));
    cmd.build();
    cmd
}

/// tmsctl's manual pages: its own, then one per command (`tmsctl-pause`), each with its file
/// name (`tmsctl-pause.1`).
fn man_pages() -> Vec<clap_mangen::Man> {
    let root = man_command();
    let mut cmds = vec![root.clone()];
    cmds.extend(root.get_subcommands().filter(|c| !c.is_hide_set()).cloned());
    cmds.into_iter()
        .map(|c| {
            // The commands' pages say whose version they describe too (by default they name the
            // command alone).
            clap_mangen::Man::new(c).source(concat!("tmsctl ", env!("CARGO_PKG_VERSION")))
        })
        .collect()
}

fn render(page: &clap_mangen::Man) -> anyhow::Result<Vec<u8>> {
    let mut roff = Vec::new();
    page.render(&mut roff)?;
    Ok(with_exit_status(&String::from_utf8(roff)?).into_bytes())
}

/// `page` with its section EXTRA (what clap_mangen makes of the text after the help: the exit
/// codes, run together into one paragraph) made the usual EXIT STATUS, its lines kept.
fn with_exit_status(page: &str) -> String {
    use clap_mangen::roff::{roman, Roff};
    let Some(start) = page.find("\n.SH EXTRA\n").map(|i| i + 1) else {
        return page.to_string();
    };
    let end = page[start + 1..]
        .find("\n.SH ")
        .map_or(page.len(), |i| start + 1 + i + 1);
    let mut section = Roff::new();
    section.control("SH", ["EXIT STATUS"]).control("nf", []);
    for line in EXIT_CODES
        .lines()
        .skip_while(|l| l.starts_with("Exit codes"))
    {
        section.text([roman(line)]);
    }
    section.control("fi", []);
    // Each rendering starts with the same preamble, which the page has already.
    let preamble = Roff::new().render();
    let section = section.render();
    let section = section.strip_prefix(&preamble).unwrap_or(&section);
    format!("{}{section}{}", &page[..start], &page[end..])
}

/// The manual page (roff) of tmsctl, or of one of its commands (`tmsctl-pause(1)`).
pub fn man_page(command: Option<&str>) -> anyhow::Result<Vec<u8>> {
    let file = match command {
        None => "tmsctl.1".to_string(),
        Some(name) => format!("tmsctl-{name}.1"),
    };
    let pages = man_pages();
    let page = pages
        .iter()
        .find(|p| p.get_filename() == file)
        .ok_or_else(|| Failure::new(Code::Usage, format!("no manual page {file}")))?;
    render(page)
}

/// Write every page into `dir` (made if missing): `tmsctl.1`, then `tmsctl-COMMAND.1` for each
/// command.
pub fn write_man_pages(dir: &Path) -> anyhow::Result<()> {
    let shown = shown_path(dir);
    std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("cannot make {shown}: {e}"))?;
    for page in man_pages() {
        let path = dir.join(page.get_filename());
        std::fs::write(&path, render(&page)?)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", shown_path(&path)))?;
    }
    Ok(())
}
