//! Safe text: what comes from elsewhere (a server's replies, another process's command line or
//! environment, a path) is escaped before it reaches the terminal, so that it cannot act on it.

use std::borrow::Cow;
use std::fmt::Write as _;

use serde_json::Value;

/// Characters that must not reach a terminal raw: control characters (C0, DEL, C1: escape
/// sequences, bells, backspaces, line breaks) and the invisible ones that reorder or hide text
/// (bidirectional formatting marks).
fn hazardous(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
        )
}

/// `s` safe to print: [hazardous] characters become `\u{1b}`-style escapes (`\n`,
/// `\t`, `\r` as such). Text that came from a server or another process goes through this
/// before it is printed. Applying it twice changes nothing more.
pub fn printable(s: &str) -> Cow<'_, str> {
    if !s.chars().any(hazardous) {
        return Cow::Borrowed(s);
    }
    let mut o = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        match c {
            '\n' => o.push_str("\\n"),
            '\t' => o.push_str("\\t"),
            '\r' => o.push_str("\\r"),
            c if hazardous(c) => {
                let _ = write!(o, "\\u{{{:x}}}", c as u32);
            }
            c => o.push(c),
        }
    }
    Cow::Owned(o)
}

/// Text of several lines made [`printable`] line by line (its line breaks kept).
pub fn printable_lines(s: &str) -> String {
    s.split('\n').map(printable).collect::<Vec<_>>().join("\n")
}

/// A path, [`printable`].
pub fn shown_path(p: &std::path::Path) -> String {
    printable(&p.display().to_string()).into_owned()
}

/// `s` quoted and escaped: `"kv"`, `"\u{1b}[2J"`.
pub fn quoted(s: &str) -> String {
    printable(&format!("{s:?}")).into_owned()
}

/// `s` on one line (white space collapsed) and [`printable`].
pub fn one_line(s: &str) -> String {
    printable(&s.split_whitespace().collect::<Vec<_>>().join(" ")).into_owned()
}

/// `v` as one line of JSON with the characters serde_json leaves raw (DEL, C1 controls,
/// bidirectional marks) escaped as well (`\u009b`), so the line is safe on a terminal too.
pub fn json_line(v: &Value) -> String {
    let s = v.to_string();
    if !s.chars().any(hazardous) {
        return s;
    }
    let mut o = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if hazardous(c) {
            let _ = write!(o, "\\u{:04x}", c as u32);
        } else {
            o.push(c);
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_from_elsewhere_cannot_act_on_the_terminal() {
        assert_eq!(printable("kv-cache 1"), "kv-cache 1");
        assert!(matches!(printable("plain"), Cow::Borrowed(_)));
        let evil = "\x1b]0;owned\x07\x1b[2J\u{9b}31m\u{7f}\u{202e}txt.exe\nnext\r\t";
        let p = printable(evil);
        assert_eq!(
            p,
            "\\u{1b}]0;owned\\u{7}\\u{1b}[2J\\u{9b}31m\\u{7f}\\u{202e}txt.exe\\nnext\\r\\t"
        );
        assert!(!p.chars().any(hazardous));
        assert_eq!(printable(&p), p, "idempotent");
        assert_eq!(printable_lines("a\x1b\nb"), "a\\u{1b}\nb");
        assert_eq!(quoted("\x1b[1m"), "\"\\u{1b}[1m\"");
        let j = json_line(&serde_json::json!({"tag": evil}));
        assert!(!j.chars().any(hazardous), "{j}");
        let back: Value = serde_json::from_str(&j).unwrap();
        assert_eq!(back["tag"], evil, "still the same JSON");
    }
}
