//! Tidy checks of the source tree, run with the tests (as rust-analyzer's `xtask tidy`): no
//! module of a crate imports a sibling that imports it back, directly or around a loop.
//!
//! A file's module path comes from where it sits (`src/exec/nodes/sync.rs` is `exec::nodes::sync`);
//! every `crate::…` path in its code (a `use` or inline) and every `super::…` import names a
//! module; a reference from `a::x` to `a::y::…` is an edge `x → y` among the children of `a`. A
//! child naming its ancestor (a module's own items) is not an edge. Test modules and comments
//! are left out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The source roots of the workspace's crates.
const ROOTS: &[&str] = &[
    "proto/src",
    "kernels/src",
    "kernels/libtpu-sys/src",
    "learner/src",
    "rollout/src",
    "rollout/serve/src",
    "actors/src",
    "orchestrator/src",
    "orchestrator/cli/src",
];

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `src/a/b.rs` → `[a, b]`; `src/a/mod.rs` → `[a]`; `src/lib.rs` → `[]`.
fn module_of(root: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(root).unwrap();
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_string());
    }
    parts
}

/// The paths a `use` tree names, braces expanded: `a::{b, c::{d}}` → `a::b`, `a::c::d`.
fn expand(tree: &str) -> Vec<String> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        return vec![tree.split(" as ").next().unwrap_or("").trim().to_string()];
    };
    let prefix = &tree[..open];
    let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
    let mut out = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, ch) in inner.char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                out.extend(
                    expand(&inner[start..i])
                        .into_iter()
                        .map(|p| format!("{prefix}{p}")),
                );
                start = i + 1;
            }
            _ => {}
        }
    }
    out.extend(
        expand(&inner[start..])
            .into_iter()
            .map(|p| format!("{prefix}{p}")),
    );
    out.retain(|p| !p.ends_with("::") && !p.is_empty());
    out
}

/// The module paths `code` (the file of module `me`) refers to, absolute, as segments.
fn references(code: &str, me: &[String]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    // `use` statements (a line that starts one, to its `;`), with `super::` resolved.
    let lines: Vec<&str> = code.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim_start();
        let body = ["use ", "pub use ", "pub(crate) use ", "pub(super) use "]
            .iter()
            .find_map(|p| line.strip_prefix(p));
        i += 1;
        let Some(body) = body else { continue };
        let mut stmt = body.to_string();
        while !stmt.contains(';') && i < lines.len() {
            stmt.push_str(lines[i]);
            i += 1;
        }
        let stmt = stmt.split(';').next().unwrap_or("");
        for p in expand(stmt) {
            let segs: Vec<&str> = p.split("::").map(str::trim).collect();
            let abs: Option<Vec<String>> = match segs.first() {
                Some(&"crate") => Some(segs[1..].iter().map(|s| s.to_string()).collect()),
                Some(&"super") => {
                    let ups = segs.iter().take_while(|s| **s == "super").count();
                    (ups <= me.len()).then(|| {
                        me[..me.len() - ups]
                            .iter()
                            .cloned()
                            .chain(segs[ups..].iter().map(|s| s.to_string()))
                            .collect()
                    })
                }
                _ => None,
            };
            out.extend(abs);
        }
    }
    // Inline `crate::a::b` paths.
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let tail = &rest[i + 7..];
        let path: String = tail
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
            .collect();
        out.push(
            path.split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
        );
        rest = tail;
    }
    out
}

#[test]
fn no_module_imports_a_sibling_that_imports_it_back() {
    let ws = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut problems = Vec::new();
    for name in ROOTS {
        let root = ws.join(name);
        let mut all = Vec::new();
        files(&root, &mut all);
        let modules: BTreeSet<Vec<String>> = all.iter().map(|f| module_of(&root, f)).collect();
        // (parent, from child, to child) → a file that makes the edge.
        let mut edges: BTreeMap<(Vec<String>, String, String), PathBuf> = BTreeMap::new();
        for f in &all {
            let me = module_of(&root, f);
            let text = std::fs::read_to_string(f).unwrap();
            // Code only: comments (and doc links) name modules without importing them.
            let code: String = text
                .split("#[cfg(test)]")
                .next()
                .unwrap_or("")
                .lines()
                .map(|l| l.split("//").next().unwrap_or(""))
                .collect::<Vec<_>>()
                .join("\n");
            for r in references(&code, &me) {
                // The longest prefix of the path that is a module of the crate.
                let target: Vec<String> = (0..=r.len())
                    .rev()
                    .map(|n| r[..n].to_vec())
                    .find(|p| modules.contains(p))
                    .unwrap_or_default();
                let common = me.iter().zip(&target).take_while(|(a, b)| a == b).count();
                if common == target.len() || common == me.len() {
                    continue; // an ancestor, itself, or a descendant
                }
                let parent = me[..common].to_vec();
                edges
                    .entry((parent, me[common].clone(), target[common].clone()))
                    .or_insert_with(|| f.clone());
            }
        }
        // A cycle among a parent's children: a path back to where it started.
        let mut by_parent: BTreeMap<&Vec<String>, BTreeMap<&str, Vec<&str>>> = BTreeMap::new();
        for (parent, from, to) in edges.keys() {
            by_parent
                .entry(parent)
                .or_default()
                .entry(from.as_str())
                .or_default()
                .push(to.as_str());
        }
        for (parent, graph) in &by_parent {
            for &start in graph.keys() {
                let mut stack = vec![(start, vec![start])];
                let mut seen = BTreeSet::new();
                while let Some((node, path)) = stack.pop() {
                    for &next in graph.get(node).into_iter().flatten() {
                        if next == start {
                            let f =
                                &edges[&((*parent).clone(), node.to_string(), next.to_string())];
                            problems.push(format!(
                                "{name}: {}::({}) import one another ({node} → {next} in {})",
                                parent.join("::"),
                                path.join(" → "),
                                f.strip_prefix(&root).unwrap_or(f).display()
                            ));
                        } else if seen.insert(next) {
                            let mut p = path.clone();
                            p.push(next);
                            stack.push((next, p));
                        }
                    }
                }
            }
        }
    }
    problems.sort();
    problems.dedup();
    assert!(
        problems.is_empty(),
        "module circles:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_checker_finds_a_circle_and_reads_use_trees() {
    assert_eq!(
        expand("crate::{a::{b, c as d}, e}"),
        ["crate::a::b", "crate::a::c", "crate::e"]
    );
    let me = vec!["x".to_string(), "y".to_string()];
    let refs = references("use super::z::{W, V};\nfn f() { crate::q::r(); }\n", &me);
    assert!(
        refs.contains(&vec!["x".into(), "z".into(), "W".into()]),
        "{refs:?}"
    );
    assert!(refs.contains(&vec!["q".into(), "r".into()]), "{refs:?}");
}
