//! The documentation's relative links: every file a link names exists, and every `#anchor`
//! into a Markdown file names one of its headings (GitHub's slugs). The README is short and
//! points into docs/, so a moved section must not leave a dead link behind.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Markdown files users read: the README, SECURITY.md, docs/ and the plugin templates'.
fn documents() -> Vec<PathBuf> {
    let root = root();
    let mut files = vec![
        root.join("README.md"),
        root.join("SECURITY.md"),
        root.join("plugins/templates/README.md"),
    ];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The text outside fenced code blocks.
fn prose(text: &str) -> String {
    let mut fenced = false;
    let mut out = String::new();
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(file: &Path) -> HashSet<String> {
    let text = std::fs::read_to_string(file).unwrap();
    prose(&text)
        .lines()
        .filter(|l| l.starts_with('#'))
        .filter_map(|l| l.trim_start_matches('#').strip_prefix(' '))
        .map(slug)
        .collect()
}

/// The targets of `[label](target)` links.
fn links(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        match after.find(')') {
            Some(end) if !after[..end].contains(char::is_whitespace) => {
                found.push(after[..end].to_string());
                rest = &after[end..];
            }
            _ => rest = after,
        }
    }
    found
}

#[test]
fn relative_links_and_anchors_resolve() {
    let mut dead = Vec::new();
    for doc in documents() {
        let text = prose(&std::fs::read_to_string(&doc).unwrap());
        for target in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let file = if path.is_empty() {
                doc.clone()
            } else {
                doc.parent().unwrap().join(path)
            };
            let name = doc
                .strip_prefix(root())
                .unwrap_or(&doc)
                .display()
                .to_string();
            if !file.exists() {
                dead.push(format!("{name}: {target} (no such file)"));
            } else if !anchor.is_empty()
                && file.extension().is_some_and(|e| e == "md")
                && !anchors(&file).contains(anchor)
            {
                dead.push(format!("{name}: {target} (no such heading)"));
            }
        }
    }
    assert!(dead.is_empty(), "dead links:\n{}", dead.join("\n"));
}

/// The README stays a page a newcomer reads in minutes; the rest belongs in docs/.
#[test]
fn the_readme_fits_a_few_screens() {
    let lines = std::fs::read_to_string(root().join("README.md"))
        .unwrap()
        .lines()
        .count();
    assert!(lines <= 160, "README.md has {lines} lines");
}

/// Every test file the documents name (`tests/….rs`, in prose or in code) exists: a suite that
/// moved must not leave its old path behind.
#[test]
fn the_test_files_the_documents_name_exist() {
    let mut missing = Vec::new();
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap();
        for (at, _) in text.match_indices("tests/") {
            // Only a path of its own, not the tail of another (`plugins/…/tests/x.rs`).
            if text[..at]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '/' || c == '_' || c == '.')
            {
                continue;
            }
            let path: String = text[at..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || matches!(c, '/' | '_' | '.' | '-'))
                .collect();
            let path = path.trim_end_matches('.');
            if path.ends_with(".rs") && !root().join(path).exists() {
                missing.push(format!("{}: {path}", doc.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "no such test file:\n{}",
        missing.join("\n")
    );
}
