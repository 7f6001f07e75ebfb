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
//!
//! A URL list (BookCorpus-style crawls, any list of files) is an entry with `url_list`: a path,
//! `file://` or `http(s)://` URL of a text file with one URL per line, optionally followed by
//! its SHA-256; blank lines and `#` comments are skipped. Each URL becomes a file at `path`,
//! where `{name}` is the URL's last path segment (characters other than letters, digits, `.`,
//! `_` and `-` become `_`):
//!
//! ```toml
//! [[source]]
//! set = "bookcorpus"
//! url_list = "{url_list}"        # --var url_list=my-books.txt
//! path = "bookcorpus/{name}"
//! ```
//!
//! [`plan_set`] turns a set into [`Job`]s (fetching checksum files and URL lists on the way);
//! [`download_set`] fetches this rank's share of them with [`crate::queue::fetch_all`]: several at
//! once, politely per host, every file tried even when one fails.

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;

use bertkit_stage_io::Ranks;

use crate::queue::{Job, QueueOptions, fetch_all};
use bertkit_stage_io::stage::{Outcome, Reporter};

use crate::{Algorithm, Checksum, DownloadError, FetchOptions, Fetched, fetch, mirrored};

/// A published checksum file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
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
#[serde(deny_unknown_fields)]
pub struct SourceEntry {
    /// The set it belongs to.
    pub set: String,
    /// Where it is published (empty: only in mirrors).
    #[serde(default)]
    pub url: String,
    /// A file listing URLs, one per line (with an optional SHA-256 after each): the entry
    /// expands once per URL, with `{name}` its last path segment.
    pub url_list: Option<String>,
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
    /// Said under the error when a file of this entry fails: what the user can do about it
    /// (a dump date the mirror no longer keeps, a site that moved).
    pub hint: Option<String>,
}

/// The registry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Registry {
    /// Every entry, in file order.
    pub source: Vec<SourceEntry>,
}

impl Registry {
    /// Parses a registry file.
    pub fn load(path: &Path) -> Result<Self, DownloadError> {
        let text = bertkit_stage_io::read_text(path).map_err(|e| DownloadError::Io {
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

/// `template` with each `{name}` replaced by `vars[name]`; a name without a value is an error
/// saying which `--var` it needs.
pub fn fill(template: &str, vars: &HashMap<String, String>) -> Result<String, DownloadError> {
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

/// How a set is fetched.
#[derive(Debug, Clone, Default)]
pub struct SetOptions {
    /// Retries, timeouts, User-Agent.
    pub fetch: FetchOptions,
    /// Concurrency and per-host politeness.
    pub queue: QueueOptions,
    /// This process's share: file `i` of the set goes to rank `i % world_size`.
    pub ranks: Ranks,
}

/// Parses a URL list: `(url, optional sha256)` per line; `name` is the list's name in errors.
pub fn parse_url_list(
    text: &str,
    name: &str,
) -> Result<Vec<(String, Option<Checksum>)>, DownloadError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        // A comment starts with `#` at the start of the line or after a space (URLs keep theirs).
        let line = match line
            .find(" #")
            .or_else(|| line.starts_with('#').then_some(0))
        {
            Some(at) => &line[..at],
            None => line,
        }
        .trim();
        if line.is_empty() {
            continue;
        }
        let parts: Vec<&str> = line.split_whitespace().collect();
        if parts.len() > 2 {
            return Err(DownloadError::Usage(format!(
                "{name}:{}: expected `URL [SHA256]`, got {line:?}",
                i + 1
            )));
        }
        let url = parts[0].to_string();
        let checksum = parts
            .get(1)
            .map(|hex| Checksum::new(Algorithm::Sha256, hex))
            .transpose()
            .map_err(|e| DownloadError::Usage(format!("{name}:{}: {e}", i + 1)))?;
        out.push((url, checksum));
    }
    Ok(out)
}

/// The file name a listed URL is saved under: its last path segment, made safe.
pub fn name_from_url(url: &str) -> Option<String> {
    let no_query = url.split(['?', '#']).next().unwrap_or(url);
    let segment = no_query.trim_end_matches('/').rsplit('/').next()?;
    let name: String = segment
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    (!name.is_empty() && name != "." && name != "..").then_some(name)
}

/// Where an auxiliary file (checksum file, URL list) goes: its own path for rank 0, a private
/// copy for other ranks, so that ranks sharing a file system never write the same file.
fn aux_dest(output: &Path, relative: &str, ranks: Ranks) -> std::path::PathBuf {
    if ranks.rank == 0 {
        output.join(relative)
    } else {
        output.join(format!(".rank-{}", ranks.rank)).join(relative)
    }
}

/// Expands `set` into the files to fetch (all ranks' files, in registry order), fetching the
/// checksum files and URL lists it refers to.
pub fn plan_set(
    registry: &Registry,
    set: &str,
    vars: &HashMap<String, String>,
    output: &Path,
    mirror: Option<&str>,
    options: &SetOptions,
    reporter: &dyn Reporter,
) -> Result<Vec<Job>, DownloadError> {
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
    let read = |path: &Path| {
        bertkit_stage_io::read_text(path).map_err(|e| DownloadError::Io {
            path: path.into(),
            source: e,
        })
    };
    let mut jobs: Vec<Job> = Vec::new();
    for entry in entries {
        if let Some(list) = &entry.url_list {
            let list = fill(list, &vars)?;
            let text = if list.starts_with("http://") || list.starts_with("https://") {
                let name = crate::queue::host_of(&list).unwrap_or("list").to_string();
                let dest = aux_dest(output, &format!(".lists/{set}-{name}.txt"), options.ranks);
                let _ = std::fs::remove_file(&dest);
                fetch(&list, &dest, None, &options.fetch, reporter)?;
                read(&dest)?
            } else {
                read(Path::new(list.strip_prefix("file://").unwrap_or(&list)))?
            };
            let mut seen: HashMap<String, String> = HashMap::new();
            for (url, checksum) in parse_url_list(&text, &list)? {
                let name = name_from_url(&url).ok_or_else(|| {
                    DownloadError::Usage(format!("{list}: no file name in {url:?}"))
                })?;
                if let Some(other) = seen.insert(name.clone(), url.clone()) {
                    return Err(DownloadError::Usage(format!(
                        "{list}: {url:?} and {other:?} would both be saved as {name:?}"
                    )));
                }
                let mut vars = vars.clone();
                vars.insert("name".into(), name);
                let path = fill(&entry.path, &vars)?;
                jobs.push(Job {
                    source: source_of(&url, &path)?,
                    dest: output.join(&path),
                    path,
                    checksum,
                });
            }
            continue;
        }
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
                let sums_dest = aux_dest(output, &sums_path, options.ranks);
                // A checksum file changes with every dump: always fetch it again.
                let _ = std::fs::remove_file(&sums_dest);
                fetch(
                    &source_of(&fill(&cf.url, &vars)?, &sums_path)?,
                    &sums_dest,
                    None,
                    &options.fetch,
                    reporter,
                )?;
                let sums = read(&sums_dest)?;
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
            jobs.push(Job {
                source: source_of(&url, &path)?,
                dest: output.join(&path),
                path,
                checksum,
            });
        }
    }
    Ok(jobs)
}

/// The set's entries' hints, each once, in registry order.
fn set_hints(registry: &Registry, set: &str) -> Vec<String> {
    let mut hints: Vec<String> = Vec::new();
    for hint in registry
        .source
        .iter()
        .filter(|s| s.set == set)
        .filter_map(|s| s.hint.as_ref())
    {
        if !hints.contains(hint) {
            hints.push(hint.clone());
        }
    }
    hints
}

/// Downloads this rank's share of `set` into `output` (from `mirror` when given), verifying
/// checksums. Every file is tried; if any failed, the error lists them all (what succeeded
/// stays, so a re-run fetches only the rest). Returns each file's relative path and outcome.
pub fn download_set(
    registry: &Registry,
    set: &str,
    vars: &HashMap<String, String>,
    output: &Path,
    mirror: Option<&str>,
    options: &SetOptions,
    reporter: &dyn Reporter,
) -> Result<Outcome<Vec<(String, Fetched)>>, DownloadError> {
    fetch_set(registry, set, vars, output, mirror, options, reporter).map_err(|error| {
        let hints = set_hints(registry, set);
        if hints.is_empty() {
            error
        } else {
            DownloadError::Hinted {
                error: Box::new(error),
                hints,
            }
        }
    })
}

fn fetch_set(
    registry: &Registry,
    set: &str,
    vars: &HashMap<String, String>,
    output: &Path,
    mirror: Option<&str>,
    options: &SetOptions,
    reporter: &dyn Reporter,
) -> Result<Outcome<Vec<(String, Fetched)>>, DownloadError> {
    let jobs = options.ranks.share(plan_set(
        registry, set, vars, output, mirror, options, reporter,
    )?);
    let results = fetch_all(&jobs, &options.queue, &options.fetch, reporter);
    let mut done = Vec::new();
    let mut failed = Vec::new();
    for (job, result) in jobs.iter().zip(results) {
        match result {
            Ok(outcome) => done.push((job.path.clone(), outcome)),
            Err(e) => failed.push(format!("{}: {e}", job.path)),
        }
    }
    if !failed.is_empty() {
        return Err(DownloadError::Incomplete {
            set: set.to_string(),
            failed: failed.len(),
            total: jobs.len(),
            errors: failed,
        });
    }
    Ok(
        if done
            .iter()
            .all(|(_, f)| matches!(f, Fetched::AlreadyPresent { .. }))
        {
            Outcome::UpToDate(done)
        } else {
            Outcome::Ran(done)
        },
    )
}
