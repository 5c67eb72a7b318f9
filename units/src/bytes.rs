//! Byte sizes: read from settings and command lines, written in messages and tables.

use crate::error::ParseError;

/// Parse a byte count: a plain integer, or one with a suffix `K`, `M`, `G`, `T` (powers of
/// 1024; `KiB`/`KB`/`k` spellings accepted). Shared by the library's settings and tmsctl.
pub fn parse_bytes(s: &str) -> Result<u64, ParseError> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || ParseError::ByteSize { text: s.into() };
    let n: u64 = num.parse().map_err(|_| bad())?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(bad()),
    };
    n.checked_mul(1u64 << shift).ok_or_else(bad)
}

/// A byte count in the largest binary unit that leaves at least 1 (up to TiB): `(1.5, "GiB")`.
/// Under 1 KiB the unit is `"B"` and the value the count itself.
pub fn scaled_bytes(bytes: u64) -> (f64, &'static str) {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    (v, UNITS[i])
}

/// `1.50 GiB`-style rendering of a byte count, shared by the library's messages and tmsctl.
pub fn human_bytes(bytes: u64) -> String {
    match scaled_bytes(bytes) {
        (_, "B") => format!("{bytes} B"),
        (v, unit) => format!("{v:.2} {unit}"),
    }
}
