//! The source registry (`pipelines/sources.toml`): named sets of files, each with where it comes
//! from, where it goes, and how to check it.
//!
//! ```toml
//! [[source]]
//! set = "squad-v1.1"
//! url = "https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v1.1.json"
//! path = "squad/dev-v1.1.json"          # under the output folder, and under a mirror
//! sha256 = "95aa6a52…"                  # or sha1 / md5, when the publisher gives one
//!
//! [[source]]
//! set = "wikipedia"
//! url = "https://dumps.wikimedia.org/enwiki/{date}/enwiki-{date}-pages-articles-multistream.xml.bz2"
//! path = "wikipedia/enwiki-{date}-pages-articles-multistream.xml.bz2"
//! checksum_file = { url = "https://dumps.wikimedia.org/enwiki/{date}/enwiki-{date}-sha1sums.txt", path = "wikipedia/enwiki-{date}-sha1sums.txt", algorithm = "sha1" }
//! ```
//!
//! Templates: `{name}` is replaced by a variable (`--var date=20240101`; `date` defaults to
//! `latest`). `ids = [...]` expands an entry once per id as `{id}`. A checksum file (lines of
//! `<hex>  <file name>`, as Wikimedia publishes) is fetched first and the file's line looked up.
//! An entry with an empty `url` exists only in mirrors (the demo set's cut-down samples).

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;

use crate::{Algorithm, Checksum, DownloadError, FetchOptions, Outcome, Progress, fetch, mirrored};

/// A published checksum file.
#[derive(Debug, Clone, Deserialize)]
pub struct ChecksumFile {
    /// Where it is published.
    pub url: String,
    /// Where it goes (and its path in a mirror).
    pub path: String,
    /// `sha256`, `sha1` or `md5`.
    pub algorithm: String,
}

/// One registry entry.
#[derive(Debug, Clone, Deserialize)]
pub struct SourceEntry {
    /// The set it belongs to.
    pub set: String,
    /// Where it is published (empty: only in mirrors).
    #[serde(default)]
    pub url: String,
    /// Relative path under the output folder and in mirrors.
    pub path: String,
    /// Expected SHA-256.
    pub sha256: Option<String>,
    /// Expected SHA-1.
    pub sha1: Option<String>,
    /// Expected MD5.
    pub md5: Option<String>,
    /// A checksum file to look the digest up in.
    pub checksum_file: Option<ChecksumFile>,
    /// Expand once per id, as `{id}`.
    pub ids: Option<Vec<u64>>,
}

/// The registry.
#[derive(Debug, Clone, Deserialize)]
pub struct Registry {
    /// Every entry, in file order.
    pub source: Vec<SourceEntry>,
}

impl Registry {
    /// Parses a registry file.
    pub fn load(path: &Path) -> Result<Self, DownloadError> {
        let text = std::fs::read_to_string(path).map_err(|e| DownloadError::Io {
            path: path.into(),
            source: e,
        })?;
        toml::from_str(&text).map_err(|e| DownloadError::Usage(format!("{}: {e}", path.display())))
    }

    /// The set names, in order of first appearance.
    pub fn sets(&self) -> Vec<&str> {
        let mut names: Vec<&str> = Vec::new();
        for s in &self.source {
            if !names.contains(&s.set.as_str()) {
                names.push(&s.set);
            }
        }
        names
    }
}

fn fill(template: &str, vars: &HashMap<String, String>) -> Result<String, DownloadError> {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let close = rest[open..]
            .find('}')
            .map(|c| open + c)
            .ok_or_else(|| DownloadError::Usage(format!("unclosed '{{' in {template:?}")))?;
        let name = &rest[open + 1..close];
        let value = vars
            .get(name)
            .ok_or_else(|| DownloadError::Usage(format!("{template:?} needs --var {name}=...")))?;
        out.push_str(value);
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

fn algorithm(name: &str) -> Result<Algorithm, DownloadError> {
    match name {
        "sha256" => Ok(Algorithm::Sha256),
        "sha1" => Ok(Algorithm::Sha1),
        "md5" => Ok(Algorithm::Md5),
        other => Err(DownloadError::Usage(format!(
            "unknown checksum algorithm {other:?}"
        ))),
    }
}

/// Looks up `file_name` in a checksum file's `<hex>  <name>` lines.
pub fn lookup_checksum(sums: &str, file_name: &str, algorithm: Algorithm) -> Option<Checksum> {
    sums.lines().find_map(|line| {
        let mut parts = line.split_whitespace();
        let hex = parts.next()?;
        let name = parts.next()?.trim_start_matches('*');
        (name == file_name)
            .then(|| Checksum::new(algorithm, hex).ok())
            .flatten()
    })
}

/// Downloads every file of `set` into `output` (from `mirror` when given), verifying checksums.
/// Returns each file's relative path and outcome.
pub fn download_set(
    registry: &Registry,
    set: &str,
    vars: &HashMap<String, String>,
    output: &Path,
    mirror: Option<&str>,
    options: &FetchOptions,
    progress: &dyn Progress,
) -> Result<Vec<(String, Outcome)>, DownloadError> {
    let entries: Vec<&SourceEntry> = registry.source.iter().filter(|s| s.set == set).collect();
    if entries.is_empty() {
        return Err(DownloadError::Usage(format!(
            "no source set {set:?}; the registry has: {}",
            registry.sets().join(", ")
        )));
    }
    let mut vars = vars.clone();
    vars.entry("date".into()).or_insert_with(|| "latest".into());
    let source_of = |url: &str, path: &str| -> Result<String, DownloadError> {
        match mirror {
            Some(m) => Ok(mirrored(m, path)),
            None if url.is_empty() => Err(DownloadError::Usage(format!(
                "{path} is only available from a mirror: pass --mirror"
            ))),
            None => Ok(url.to_string()),
        }
    };
    let mut done = Vec::new();
    for entry in entries {
        let ids: Vec<Option<u64>> = match &entry.ids {
            Some(ids) => ids.iter().map(|&i| Some(i)).collect(),
            None => vec![None],
        };
        for id in ids {
            let mut vars = vars.clone();
            if let Some(id) = id {
                vars.insert("id".into(), id.to_string());
            }
            let path = fill(&entry.path, &vars)?;
            let url = fill(&entry.url, &vars)?;
            let mut checksum = Checksum::from_one_of(
                entry.sha256.as_deref(),
                entry.sha1.as_deref(),
                entry.md5.as_deref(),
            )?;
            if let Some(cf) = &entry.checksum_file {
                let sums_path = fill(&cf.path, &vars)?;
                let sums_dest = output.join(&sums_path);
                // A checksum file changes with every dump: always fetch it again.
                let _ = std::fs::remove_file(&sums_dest);
                fetch(
                    &source_of(&fill(&cf.url, &vars)?, &sums_path)?,
                    &sums_dest,
                    None,
                    options,
                    progress,
                )?;
                let sums = std::fs::read_to_string(&sums_dest).map_err(|e| DownloadError::Io {
                    path: sums_dest.clone(),
                    source: e,
                })?;
                let name = Path::new(&path)
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                checksum = lookup_checksum(&sums, &name, algorithm(&cf.algorithm)?);
                if checksum.is_none() {
                    return Err(DownloadError::Usage(format!(
                        "{name} is not listed in {sums_path}"
                    )));
                }
            }
            let outcome = fetch(
                &source_of(&url, &path)?,
                &output.join(&path),
                checksum.as_ref(),
                options,
                progress,
            )?;
            done.push((path, outcome));
        }
    }
    Ok(done)
}
