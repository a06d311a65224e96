//! Text from outside the host — a plugin's log lines and failure reasons, the database's error
//! messages (which quote a plugin's values) — made safe for the host's log and headers: control
//! characters escaped, so no line can be forged, and the length bounded, so no flood.

/// Longest failure reason or database error text the host keeps (and logs, and puts in a
/// dead letter's header), after escaping.
pub(crate) const MAX_REASON_BYTES: usize = 1024;

/// `text` with every character that could end, rewrite or reorder a log line escaped (`\n`,
/// `\r`, `\t`, other control characters and Unicode line, paragraph and direction controls as
/// `\u{…}`), cut to at most `max` bytes with a note of how much was cut.
pub(crate) fn bounded(text: &str, max: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max));
    for (at, c) in text.char_indices() {
        let piece: std::borrow::Cow<'_, str> = match c {
            '\n' => "\\n".into(),
            '\r' => "\\r".into(),
            '\t' => "\\t".into(),
            c if needs_escape(c) => format!("\\u{{{:x}}}", c as u32).into(),
            c => text[at..at + c.len_utf8()].into(),
        };
        if out.len() + piece.len() > max {
            let rest = text.len() - at;
            out.push_str(&format!("…[{rest} more bytes]"));
            return out;
        }
        out.push_str(&piece);
    }
    out
}

/// [`bounded`] to [`MAX_REASON_BYTES`].
pub(crate) fn reason(text: &str) -> String {
    bounded(text, MAX_REASON_BYTES)
}

fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(c,
            '\u{2028}' | '\u{2029}' // line and paragraph separators
            | '\u{200e}' | '\u{200f}' | '\u{061c}' // direction marks
            | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' // direction overrides
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_character_that_breaks_a_line_survives() {
        let forged = "ok\n2026-12-05T00:00:00Z  WARN idemhost::admin: FORGED\r\x1b[2K\u{2028}\u{202e}x\u{85}";
        let out = bounded(forged, 4096);
        assert!(
            !out.chars().any(|c| c.is_control() || needs_escape(c)),
            "{out:?}"
        );
        assert!(out.starts_with("ok\\n2026"), "{out}");
        // Every code point, one at a time.
        for c in (0u32..0x11_0000).filter_map(char::from_u32) {
            let out = bounded(&c.to_string(), 64);
            assert!(
                !out.chars().any(|o| o.is_control() || needs_escape(o)),
                "U+{:04X} -> {out:?}",
                c as u32
            );
        }
    }

    #[test]
    fn length_is_bounded_whatever_the_input() {
        for len in [0, 1, 1023, 1024, 1025, 5000, 1 << 20] {
            for unit in ["x", "\n", "é", "\u{202e}", "\u{1F600}"] {
                let text = unit.repeat(len);
                let out = bounded(&text, 1024);
                // The note of what was cut is at most ~25 bytes beyond the bound.
                assert!(out.len() <= 1024 + 32, "{len} x {unit:?}: {}", out.len());
            }
        }
        assert_eq!(bounded("short", 1024), "short");
    }
}
