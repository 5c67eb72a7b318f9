//! Parsing and printing of byte sizes and boolean flags, shared by the environment settings.

use crate::error::{Error, Result};

/// Parse a byte count: a plain integer, or one with a suffix `K`, `M`, `G`, `T` (powers of 1024;
/// `KiB`/`KB`/`k` spellings accepted).
pub fn parse_bytes(s: &str) -> Result<u64> {
    Ok(tms_units::parse_bytes(s)?)
}

/// Parse a flag: `1`/`true`/`yes`/`on` or `0`/`false`/`no`/`off` (any case); empty is off, as
/// `VAR= program` reads in a shell.
pub fn parse_flag(s: &str) -> Result<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" | "" => Ok(false),
        _ => Err(Error::invalid_argument(format!(
            "{s:?} is not a flag (use 1 or 0)"
        ))),
    }
}

/// Read an environment variable through `parse`, naming the variable in any error.
pub fn env_parsed<T>(name: &str, parse: impl FnOnce(&str) -> Result<T>) -> Result<Option<T>> {
    match std::env::var(name) {
        Ok(v) => var_parsed(name, Some(&v), parse),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(Error::invalid_argument(format!(
            "environment variable {name} is not valid UTF-8"
        ))),
    }
}

/// Parse the value `raw` of the variable `name` (absent: `None`), naming it in any error.
pub fn var_parsed<T>(
    name: &str,
    raw: Option<&str>,
    parse: impl FnOnce(&str) -> Result<T>,
) -> Result<Option<T>> {
    raw.map(|v| parse(v).map_err(|e| e.context(format!("environment variable {name}"))))
        .transpose()
}

/// `1.50 GiB`-style rendering.
pub fn human(bytes: u64) -> String {
    tms_units::human_bytes(bytes)
}

/// Chunk indices for messages: `chunk 3`, `chunks 0-3,8`.
pub fn ranges(idx: &[usize]) -> String {
    match idx {
        [one] => format!("chunk {one}"),
        _ => format!("chunks {}", tms_units::format_ranges(idx)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes() {
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("2MiB").unwrap(), 2 << 20);
        assert_eq!(parse_bytes("8G").unwrap(), 8 << 30);
        assert_eq!(parse_bytes(" 3 kb ").unwrap(), 3 << 10);
        assert!(parse_bytes("").is_err());
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("1.5G").is_err());
        assert!(parse_bytes("99999999999T").is_err());
    }

    #[test]
    fn flags() {
        assert!(parse_flag("1").unwrap());
        assert!(parse_flag("TRUE").unwrap());
        assert!(!parse_flag("0").unwrap());
        assert!(!parse_flag("").unwrap() && !parse_flag(" Off ").unwrap());
        let e = parse_flag("maybe").unwrap_err().to_string();
        assert!(e.contains("maybe"), "{e}");
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(3 << 29), "1.50 GiB");
    }
}
