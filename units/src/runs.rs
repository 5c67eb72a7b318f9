//! Runs of chunk indices: the one home of their forms. Sorted, distinct indices (`[2,3,4,9]`)
//! travel as inclusive ranges (`[[2,4],[9,9]]`, the control protocol's `ChunkRanges`), so that a
//! request naming many chunks still fits a line; people read and type them as `2-4,9`.

use crate::error::{ListFault, ParseError};

/// The ranges of sorted, distinct chunk indices (`[2,3,4,9]` -> `[[2,4],[9,9]]`).
pub fn chunk_ranges(idx: &[usize]) -> Vec<[u64; 2]> {
    let mut out: Vec<[u64; 2]> = Vec::new();
    for &i in idx {
        let i = i as u64;
        match out.last_mut() {
            Some(r) if r[1].checked_add(1) == Some(i) => r[1] = i,
            _ => out.push([i, i]),
        }
    }
    out
}

/// The chunk indices of `ranges`, sorted, each once (ranges may overlap or come in any order).
/// At most `limit` indices in all, counted before duplicates go.
pub fn expand_chunk_ranges(ranges: &[[u64; 2]], limit: usize) -> Result<Vec<usize>, ParseError> {
    let mut total: u64 = 0;
    for &[a, b] in ranges {
        if a > b {
            return Err(ParseError::RangeBackwards { first: a, last: b });
        }
        total = total.saturating_add((b - a).saturating_add(1));
        if total > limit as u64 {
            return Err(ParseError::TooManyChunks { limit });
        }
    }
    let mut out = Vec::with_capacity(total as usize);
    let index =
        |chunk: u64| usize::try_from(chunk).map_err(|_| ParseError::ChunkOutOfRange { chunk });
    for &[a, b] in ranges {
        // Bounded by `limit` above; indices past usize cannot be chunks of anything.
        let (a, b) = (index(a)?, index(b)?);
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// Chunk ranges as `--chunks` takes them: `[[8,15],[20,20]]` -> `"8-15,20"` (`""` for none).
pub fn format_chunk_ranges(ranges: &[[u64; 2]]) -> String {
    ranges
        .iter()
        .map(|&[a, b]| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Chunk indices as ranges, the way `tmsctl --chunks` takes them: `"0-3,8,10-11"` (sorted,
/// each index once; `""` for none).
pub fn format_ranges(idx: &[usize]) -> String {
    format_chunk_ranges(&chunk_ranges(idx))
}

/// Parse chunk indices: comma-separated indices and inclusive ranges (`"8-15,20"`), returned
/// sorted, each once; no whitespace. At most `limit` indices, so that a typo cannot ask for
/// billions.
pub fn parse_ranges(s: &str, limit: usize) -> Result<Vec<usize>, ParseError> {
    let bad = |fault: ListFault| ParseError::ChunkList {
        text: s.into(),
        fault,
    };
    // One way to write a list: a stray space is more likely a mistake (a shell quote, two
    // arguments run together) than a layout.
    if s.chars().any(char::is_whitespace) {
        return Err(bad(ListFault::Whitespace));
    }
    let mut out = Vec::new();
    for part in s.split(',') {
        if part.is_empty() {
            return Err(bad(ListFault::EmptyItem));
        }
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a, b),
            None => (part, part),
        };
        // Digits only: `parse` would take "+1" for 1.
        let num = |x: &str| {
            x.bytes()
                .all(|b| b.is_ascii_digit())
                .then(|| x.parse::<usize>().ok())
                .flatten()
                .ok_or_else(|| bad(ListFault::NotAnIndex { item: x.into() }))
        };
        let (a, b) = (num(a)?, num(b)?);
        if a > b {
            return Err(bad(ListFault::Backwards { first: a, last: b }));
        }
        if b - a >= limit || out.len() + (b - a + 1) > limit {
            return Err(bad(ListFault::TooMany { limit }));
        }
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The protocol's limit (`tms_proto::MAX_CHUNK_INDICES`).
    const MAX_CHUNK_INDICES: usize = 1 << 20;

    #[test]
    fn chunk_ranges_round_trip_and_bad_lists_are_refused() {
        assert_eq!(
            parse_ranges("8-11,2,3,9", 100).unwrap(),
            vec![2, 3, 8, 9, 10, 11]
        );
        assert_eq!(format_ranges(&[2, 3, 8, 9, 10, 11, 20]), "2-3,8-11,20");
        assert_eq!(format_ranges(&[]), "");
        for (bad, why) in [
            ("", "empty item"),
            ("1,,2", "empty item"),
            ("x", "is not an index"),
            ("5-2", "runs backwards"),
            ("0-1000000000", "more than 100 chunks"),
            ("-3", "is not an index"),
            ("+1", "is not an index"),
            ("1-+2", "is not an index"),
            // Issue 36, item 5: whitespace anywhere is refused, not trimmed away.
            (" 1", "whitespace is not allowed"),
            ("8-11, 2", "whitespace is not allowed"),
            ("1 -2", "whitespace is not allowed"),
            ("3\t", "whitespace is not allowed"),
        ] {
            let e = parse_ranges(bad, 100).unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    #[test]
    fn chunk_ranges_on_the_wire() {
        assert_eq!(chunk_ranges(&[]), Vec::<[u64; 2]>::new());
        assert_eq!(chunk_ranges(&[2, 3, 4, 9]), vec![[2, 4], [9, 9]]);
        assert_eq!(chunk_ranges(&[0, 2, 4]), vec![[0, 0], [2, 2], [4, 4]]);
        for idx in [
            vec![],
            vec![0],
            vec![1, 2, 3, 7, 8, 100],
            (0..1000).collect(),
        ] {
            assert_eq!(
                expand_chunk_ranges(&chunk_ranges(&idx), MAX_CHUNK_INDICES),
                Ok(idx)
            );
        }
        // Any order, overlaps: sorted, each once.
        assert_eq!(
            expand_chunk_ranges(&[[9, 9], [2, 4], [3, 5]], 100),
            Ok(vec![2, 3, 4, 5, 9])
        );
        // Backwards, too many, too many through overlaps, huge: refused, without expanding.
        let e = expand_chunk_ranges(&[[5, 2]], 100).unwrap_err().to_string();
        assert!(e.contains("5-2 runs backwards"), "{e}");
        for bad in [
            vec![[0, 100]],
            vec![[0, 60], [0, 60]],
            vec![[0, u64::MAX]],
            vec![[u64::MAX, u64::MAX], [0, u64::MAX]],
        ] {
            let e = expand_chunk_ranges(&bad, 100).unwrap_err().to_string();
            assert!(e.contains("more than 100 chunks"), "{bad:?}: {e}");
        }
        assert_eq!(
            expand_chunk_ranges(&[[0, 99]], 100).map(|v| v.len()),
            Ok(100)
        );
    }

    #[test]
    fn ranges_read_as_they_are_typed() {
        assert_eq!(format_chunk_ranges(&[[8, 15], [20, 20]]), "8-15,20");
        assert_eq!(format_chunk_ranges(&[]), "");
    }
}
