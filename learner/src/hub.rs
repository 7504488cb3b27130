//! Hugging Face Hub ids (`Qwen/Qwen2.5-0.5B-Instruct`) resolved against the local Hub cache, as
//! `transformers` finds a model it downloaded before: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
//! `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`; the snapshot `refs/main`
//! names, else the newest one.
//!
//! Owns: the cache layout and the download hint. Never: downloads (no network here; the hint
//! says how).

use std::path::{Path, PathBuf};

/// Whether `s` has the shape of a Hub repo id: `owner/name`, each of letters, digits, `-`, `_`,
/// `.` (not `.` or `..`).
pub fn is_repo_id(s: &str) -> bool {
    let part = |p: &str| {
        !p.is_empty()
            && p != "."
            && p != ".."
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    matches!(s.split_once('/'), Some((owner, name)) if part(owner) && part(name))
}

/// The Hub cache folder this host uses.
pub fn cache_dir() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = var("HF_HUB_CACHE") {
        return d;
    }
    if let Some(d) = var("HF_HOME") {
        return d.join("hub");
    }
    if let Some(d) = var("XDG_CACHE_HOME") {
        return d.join("huggingface/hub");
    }
    var("HOME")
        .unwrap_or_else(|| PathBuf::from("."))
        .join(".cache/huggingface/hub")
}

/// The snapshot folder of model `id` in `cache`, when it was downloaded there.
pub fn find_in(cache: &Path, id: &str) -> Option<PathBuf> {
    if !is_repo_id(id) {
        return None;
    }
    let repo = cache.join(format!("models--{}", id.replace('/', "--")));
    let snapshots = repo.join("snapshots");
    if let Ok(rev) = std::fs::read_to_string(repo.join("refs/main")) {
        let dir = snapshots.join(rev.trim());
        if dir.is_dir() {
            return Some(dir);
        }
    }
    // No ref (a download of a pinned revision): the newest snapshot.
    std::fs::read_dir(&snapshots)
        .ok()?
        .flatten()
        .filter(|e| e.path().is_dir())
        .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok())
        .map(|e| e.path())
}

/// The snapshot folder of model `id` in this host's cache.
pub fn find(id: &str) -> Option<PathBuf> {
    find_in(&cache_dir(), id)
}

/// What to tell someone whose model `id` is not in the cache.
pub fn download_hint(id: &str) -> String {
    format!(
        "not in the Hugging Face cache ({}): download it with `hf download {id}` (huggingface_hub), or give the path of a checkpoint folder",
        cache_dir().display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_are_told_from_paths() {
        let cases = [
            ("Qwen/Qwen2.5-0.5B-Instruct", true),
            ("meta-llama/Llama-3.2-1B", true),
            ("./Qwen/x", false),
            ("/abs/x", false),
            ("a/b/c", false),
            ("checkpoint", false),
            ("../x", false),
            ("a/", false),
            ("a b/c", false),
        ];
        for (s, want) in cases {
            assert_eq!(is_repo_id(s), want, "{s}");
        }
    }

    #[test]
    fn a_snapshot_is_found_by_its_main_ref_else_the_newest() {
        let cache = std::env::temp_dir().join(format!("trellis-hub-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&cache);
        let repo = cache.join("models--Qwen--Qwen2.5-0.5B-Instruct");
        for rev in ["aaa111", "bbb222"] {
            std::fs::create_dir_all(repo.join("snapshots").join(rev)).unwrap();
        }
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), "aaa111\n").unwrap();
        assert_eq!(
            find_in(&cache, "Qwen/Qwen2.5-0.5B-Instruct"),
            Some(repo.join("snapshots/aaa111"))
        );
        std::fs::remove_file(repo.join("refs/main")).unwrap();
        std::fs::remove_dir(repo.join("snapshots/aaa111")).unwrap();
        assert_eq!(
            find_in(&cache, "Qwen/Qwen2.5-0.5B-Instruct"),
            Some(repo.join("snapshots/bbb222"))
        );
        assert_eq!(find_in(&cache, "Qwen/Other"), None);
        std::fs::remove_dir_all(&cache).unwrap();
    }
}
