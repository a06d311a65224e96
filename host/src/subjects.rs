//! NATS subjects: what a subject and a pattern may be, which are reserved, and matching a
//! subject against a pattern, and names made from them. Shared by the configuration's checks,
//! the outbox and the binding.

/// Longest event subject a plugin may publish to.
const MAX_SUBJECT_BYTES: usize = 256;

/// Prefixes never published to from a plugin: the server's and JetStream's API (`$JS`, `$KV`,
/// `$O`, `$SYS`, ...) and request inboxes (replies a client waits for).
const RESERVED_PREFIXES: [&str; 3] = ["$", "_INBOX.", "_R_."];

/// Checks an event subject a plugin publishes to: a literal NATS subject, not reserved.
pub(crate) fn check_subject(subject: &str) -> Result<(), String> {
    let bad = subject.is_empty()
        || subject.len() > MAX_SUBJECT_BYTES
        || subject
            .split('.')
            .any(|t| t.is_empty() || t == "*" || t == ">")
        || subject.chars().any(|c| c.is_whitespace() || c.is_control());
    if bad {
        return Err(format!(
            "invalid event subject {subject:?}: a literal NATS subject (no wildcards, no spaces, at most {MAX_SUBJECT_BYTES} bytes)"
        ));
    }
    if RESERVED_PREFIXES.iter().any(|p| subject.starts_with(p)) {
        return Err(format!(
            "event subject {subject:?} is reserved (`$` subjects and request inboxes are never published from a plugin)"
        ));
    }
    Ok(())
}

/// Checks a `publish_subjects` pattern: NATS tokens, `*` for one, `>` only last, never a
/// reserved prefix.
pub(crate) fn check_pattern(pattern: &str) -> Result<(), String> {
    let tokens: Vec<&str> = pattern.split('.').collect();
    let bad = pattern.is_empty()
        || pattern.chars().any(|c| c.is_whitespace() || c.is_control())
        || tokens.iter().any(|t| t.is_empty())
        || tokens[..tokens.len() - 1].contains(&">");
    if bad {
        return Err(format!(
            "{pattern:?} is not a NATS subject pattern (tokens separated by `.`, `*` for one token, `>` last)"
        ));
    }
    if RESERVED_PREFIXES.iter().any(|p| pattern.starts_with(p)) {
        return Err(format!(
            "{pattern:?} is reserved: `$` subjects (JetStream API, KV, object store) and inboxes are never allowed"
        ));
    }
    Ok(())
}

/// Whether NATS subject `pattern` (with `*` and `>` wildcards) matches literal `subject`.
pub fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut subject_tokens = subject.split('.');
    for p in pattern.split('.') {
        match (p, subject_tokens.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (p, Some(t)) if p == t => {}
            _ => return false,
        }
    }
    subject_tokens.next().is_none()
}

/// Whether two NATS subject patterns match a subject in common (`*`: one token, `>`: one or
/// more at the end).
pub(crate) fn patterns_overlap(a: &str, b: &str) -> bool {
    fn overlap(a: &[&str], b: &[&str]) -> bool {
        match (a.split_first(), b.split_first()) {
            (None, None) => true,
            (Some((&">", _)), Some(_)) | (Some(_), Some((&">", _))) => true,
            (Some((x, a)), Some((y, b))) => (*x == "*" || *y == "*" || x == y) && overlap(a, b),
            _ => false,
        }
    }
    let (a, b): (Vec<&str>, Vec<&str>) = (a.split('.').collect(), b.split('.').collect());
    overlap(&a, &b)
}

/// `name` with every character a stream name may not hold replaced by `_`.
pub(crate) fn stream_safe(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subject_patterns_overlap_as_nats_matches_them() {
        for (a, b, expected) in [
            ("orders.>", "orders.*.*", true),
            ("orders.*", "orders.*.*", false),
            (">", "orders.*.*", true),
            ("orders.*.>", "orders.*.*", true),
            ("orders.eu.*", "orders.*.*", true),
            ("orders.eu", "orders.*.*", false),
            ("orders.*.placed", "orders.*.*", true),
            ("other.>", "orders.*.*", false),
            ("orders.a.b.c", "orders.*.*", false),
            ("*.*.*", "orders.*.*", true),
            ("orders.>", "orders", false),
        ] {
            assert_eq!(patterns_overlap(a, b), expected, "{a} ~ {b}");
            assert_eq!(patterns_overlap(b, a), expected, "{b} ~ {a}");
        }
    }

    #[test]
    fn subjects_match_with_wildcards() {
        assert!(subject_matches("dlq.inventory", "dlq.inventory"));
        assert!(subject_matches("dlq.*", "dlq.inventory"));
        assert!(subject_matches("orders.>", "orders.dlq.x"));
        for (filter, subject, expected) in [
            ("orders.placed", "orders.placed.x", false),
            ("orders.*", "orders.placed.x", false),
            ("orders.*", "orders", false),
            ("orders.>", "orders", false),
            ("*.placed", "orders.placed", true),
            (">", "a.b.c", true),
        ] {
            assert_eq!(
                subject_matches(filter, subject),
                expected,
                "{filter} {subject}"
            );
        }
        assert!(!subject_matches("orders.placed", "orders.dlq"));
        assert!(!subject_matches("orders.*", "orders.dlq.x"));
        assert!(!subject_matches("orders.placed.x", "orders.placed"));
    }

    #[test]
    fn patterns_are_nats_tokens_and_never_reserved() {
        for p in ["$JS.>", ">.a", "a..b", "", "$KV.*.*", "_INBOX.>"] {
            assert!(check_pattern(p).is_err(), "{p:?}");
        }
        for p in ["a", "a.*", "a.>", ">", "*.b"] {
            assert!(check_pattern(p).is_ok(), "{p:?}");
        }
    }
}
