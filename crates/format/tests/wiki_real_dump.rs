//! The wiki format stage on the real enwiki dump chunk in the shared data folder.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use bertkit_format::wiki::{WikiCounts, WikiOptions, format_wiki};
use bertkit_format::{FormatError, FormatManifest};
use bertkit_stage_io::stage::{Outcome, Silent};

type RunOutcome = Outcome<FormatManifest>;
use bertkit_test_support::require;

const ENWIKI: &str =
    "wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2";
const TABLES: &str = "wikipedia/enwiki-table-markup.xml.bz2";

fn enwiki_xml() -> Vec<u8> {
    let mut xml = Vec::new();
    bzip2::read::MultiBzDecoder::new(fs::File::open(require(ENWIKI)).unwrap())
        .read_to_end(&mut xml)
        .unwrap();
    xml
}

fn run(inputs: &[PathBuf], out: &Path, options: &WikiOptions) -> Result<RunOutcome, FormatError> {
    format_wiki(inputs, out, options, &Silent)
}

fn counts(outcome: &RunOutcome) -> WikiCounts {
    serde_json::from_value(outcome.summary().counts.clone()).unwrap()
}

/// All output text of a run, files concatenated in order.
fn output_text(out: &Path, outcome: &RunOutcome) -> String {
    outcome
        .summary()
        .outputs
        .iter()
        .map(|f| fs::read_to_string(out.join(&f.file)).unwrap())
        .collect()
}

/// Splits XML into bzip2 streams of `pages_per_stream` pages, as Wikipedia's multistream
/// dumps are built: the header alone first, then runs of whole pages, the footer with the last.
fn multistream(xml: &[u8], pages_per_stream: usize) -> Vec<u8> {
    multistream_with_starts(xml, pages_per_stream).0
}

/// Where each stream of [`multistream`]'s output starts, in compressed bytes.
fn stream_starts(xml: &[u8], pages_per_stream: usize) -> Vec<usize> {
    multistream_with_starts(xml, pages_per_stream).1
}

fn multistream_with_starts(xml: &[u8], pages_per_stream: usize) -> (Vec<u8>, Vec<usize>) {
    let text = std::str::from_utf8(xml).unwrap();
    let starts: Vec<usize> = text.match_indices("<page>").map(|(i, _)| i).collect();
    let mut cuts = vec![0, starts[0]];
    cuts.extend(
        starts
            .iter()
            .skip(pages_per_stream)
            .step_by(pages_per_stream),
    );
    cuts.push(xml.len());
    let mut out = Vec::new();
    let mut starts = Vec::new();
    for w in cuts.windows(2) {
        let mut enc = bzip2::write::BzEncoder::new(Vec::new(), bzip2::Compression::new(9));
        enc.write_all(&xml[w[0]..w[1]]).unwrap();
        starts.push(out.len());
        out.extend(enc.finish().unwrap());
    }
    (out, starts)
}

#[test]
fn enwiki_chunk_counts_residue_and_known_sentences() {
    let dir = tempfile::tempdir().unwrap();
    let outcome = run(&[require(ENWIKI)], dir.path(), &WikiOptions::default()).unwrap();
    let c = counts(&outcome);
    assert_eq!(c.pages_seen, 206);
    assert_eq!(c.redirects_skipped, 100);
    assert_eq!(c.articles, 106);
    assert_eq!(c.non_article_pages_skipped, 0);
    assert_eq!(c.disambiguation_skipped, 8);
    // "List of anthropologists" is only lists, which are dropped by default.
    assert_eq!(c.empty_articles_skipped, 1);
    assert_eq!(c.articles_written, 97);
    assert_eq!(c.errors, 0);
    assert_eq!(c.xml_bytes, 6_089_746);

    let text = output_text(dir.path(), &outcome);
    for residue in [
        "{{", "}}", "[[", "]]", "{|", "|}", "<ref", "</ref", "&nbsp;", "&amp;", "'''", "==",
        "<!--", "__TOC__",
    ] {
        assert!(
            !text.contains(residue),
            "markup residue {residue:?} in the output"
        );
    }
    // Format: documents separated by exactly one blank line, no blank line runs.
    assert!(text.ends_with("\n\n") && !text.contains("\n\n\n"));
    assert_eq!(text.split("\n\n").filter(|d| !d.is_empty()).count(), 97);
    assert!(text.lines().all(|l| l.trim() == l), "lines are trimmed");
    let lines: std::collections::HashSet<&str> = text.lines().collect();
    for sentence in [
        "Anarchism is a political philosophy that advocates self-governed societies based on voluntary institutions.",
        "Anarchism considers the state to be undesirable, unnecessary, and harmful.",
        "Alabama is a state located in the southeastern region of the United States.",
        "Abraham Lincoln (February 12, 1809 – April 15, 1865) was the 16th President of the United States, serving from March 1861 until his assassination in April 1865.",
        "The first known use of this word was in 1539.",
    ] {
        assert!(lines.contains(sentence), "missing sentence: {sentence}");
    }
    // Real sentence boundaries around abbreviations, initials and decimals: each must be one
    // whole line, neither split nor glued to its neighbour.
    for sentence in [
        "Also M. E. Lazarus was an important American individualist anarchist who promoted free love.",
        "Experiments in Germany led to A. S. Neill founding what became Summerhill School in 1921.",
        "They encouraged playing with sexual roles and sexuality, and the openly bisexual radical Edna St. Vincent Millay and the lesbian anarchist Margaret Anderson were prominent among them.",
        "Human activities (e.g. deforestation, farming, and urbanization) change the albedo of various areas around the globe.",
        "We may suppose this paper is divided into squares like a child's arithmetic book....I assume then that the computation is carried out on one-dimensional paper, i.e., on a tape divided into squares.",
        "The overall albedo of the Moon is measured to be around 0.136, but it is strongly directional and non-Lambertian, displaying also a strong opposition effect.",
        "The sex ratio averages 4.3:1 and is greatly modified by cognitive impairment: it may be close to 2:1 with intellectual disability and more than 5.5:1 without.",
        "In surveys of U.S. scholars ranking presidents conducted since the 1940s, Lincoln is consistently ranked in the top three, often as number one.",
    ] {
        assert!(lines.contains(sentence), "not a whole line: {sentence}");
    }
}

#[test]
fn longest_articles_keep_their_prose() {
    let dir = tempfile::tempdir().unwrap();
    let outcome = run(&[require(ENWIKI)], dir.path(), &WikiOptions::default()).unwrap();
    let text = output_text(dir.path(), &outcome);
    let docs: Vec<&str> = text.split("\n\n").collect();
    let xml = String::from_utf8(enwiki_xml()).unwrap();
    // (title, first sentence, a sentence from the article's last prose section)
    let cases = [
        (
            "Anarchism",
            "Anarchism is a political philosophy",
            "Godwin saw that the main goal of education should be the promotion of happiness.",
        ),
        (
            "Azerbaijan",
            "Azerbaijan, officially the Republic of Azerbaijan",
            "There are three state-owned television channels: AzTV, Idman TV and Medeniyyet TV.",
        ),
        (
            "Alkali metal",
            "The alkali metals are a group (column) in the periodic table",
            "The liquid or gaseous product (the alkali metal) then undergoes fractional distillation for purification.",
        ),
        (
            "Abraham Lincoln",
            "Abraham Lincoln (February 12, 1809",
            "In surveys of U.S. scholars ranking presidents conducted since the 1940s, Lincoln is consistently ranked in the top three, often as number one.",
        ),
        (
            "Alabama",
            "Alabama is a state located in the southeastern region",
            "Colleges and universities in Alabama offer degree programs from two-year associate degrees to a multitude of doctoral level programs.",
        ),
    ];
    for (title, first, late) in cases {
        let start = xml.find(&format!("<title>{title}</title>")).unwrap();
        let body = &xml[start..];
        let t0 = body.find("<text").unwrap();
        let t1 = body.find("</text>").unwrap();
        let wikitext_len = t1 - t0;
        let doc = docs
            .iter()
            .find(|d| d.starts_with(first))
            .unwrap_or_else(|| panic!("no document for {title}"));
        assert!(
            doc.lines().any(|l| l == late),
            "{title}: late sentence lost"
        );
        // Wikitext is about two-thirds markup, references and tables; WikiExtractor keeps
        // 30-51% of these five articles' wikitext bytes, and bertkit 98-99% of what it keeps
        // (BENCHMARKS.md).
        let ratio = doc.len() as f64 / wikitext_len as f64;
        assert!(
            ratio > 0.30,
            "{title}: only {ratio:.2} of the wikitext size kept"
        );
    }
}

#[test]
fn table_markup_dump_without_siteinfo() {
    let dir = tempfile::tempdir().unwrap();
    let outcome = run(&[require(TABLES)], dir.path(), &WikiOptions::default()).unwrap();
    let c = counts(&outcome);
    assert_eq!(c.pages_seen, 5);
    assert_eq!(c.articles, 5);
    assert_eq!(c.articles_written, 5);
    let text = output_text(dir.path(), &outcome);
    for residue in [
        "{|", "|}", "|-", "||", "{{", "}}", "[[", "]]", "colspan", "rowspan", "style=", "class=",
    ] {
        assert!(!text.contains(residue), "table residue {residue:?}");
    }
    assert!(text.contains(
        "The constructive vote of no confidence (in German: konstruktives Misstrauensvotum, in Spanish: moción de censura constructiva) is a variation on the motion of no confidence which allows a parliament to withdraw confidence from a head of government only if there is a positive majority for a prospective successor."
    ));
}

#[test]
fn multistream_plain_and_single_stream_give_identical_output_at_any_thread_count() {
    let tmp = tempfile::tempdir().unwrap();
    let xml = enwiki_xml();
    let plain = tmp.path().join("enwiki.xml");
    fs::write(&plain, &xml).unwrap();
    let multi = tmp.path().join("enwiki-multistream.xml.bz2");
    fs::write(&multi, multistream(&xml, 7)).unwrap();
    assert_eq!(
        bertkit_format::wiki::source::detect(&multi).unwrap(),
        bertkit_format::wiki::InputKind::Bzip2Multistream
    );
    assert_eq!(
        bertkit_format::wiki::source::detect(&require(ENWIKI)).unwrap(),
        bertkit_format::wiki::InputKind::Bzip2
    );
    assert_eq!(
        bertkit_format::wiki::source::detect(&plain).unwrap(),
        bertkit_format::wiki::InputKind::Xml
    );

    let reference_dir = tmp.path().join("single");
    let reference = run(
        &[require(ENWIKI)],
        &reference_dir,
        &WikiOptions {
            threads: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let reference_text = output_text(&reference_dir, &reference);
    for (name, input, threads, segment_bytes) in [
        ("multi-1", &multi, 1, 1 << 20),
        ("multi-3", &multi, 3, 64 << 10),
        ("plain-3", &plain, 3, 100 << 10),
        ("single-4", &require(ENWIKI), 4, 32 << 10),
    ] {
        let out = tmp.path().join(name);
        let options = WikiOptions {
            threads,
            segment_bytes,
            ..Default::default()
        };
        let outcome = run(std::slice::from_ref(input), &out, &options).unwrap();
        assert_eq!(
            output_text(&out, &outcome),
            reference_text,
            "{name} differs from the single-stream run"
        );
        assert_eq!(counts(&outcome), counts(&reference), "{name} counts differ");
        assert_eq!(outcome.summary().outputs, reference.summary().outputs);
    }
}

#[test]
fn truncated_bz2_is_an_error_with_offset_and_leaves_no_output() {
    let tmp = tempfile::tempdir().unwrap();
    let bytes = fs::read(require(ENWIKI)).unwrap();
    let cut = tmp.path().join("cut.xml.bz2");
    fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let out = tmp.path().join("out");
    let err = run(std::slice::from_ref(&cut), &out, &WikiOptions::default()).unwrap_err();
    let msg = err.to_string();
    // A single stream cut short ends where the file does: the offset is the cut.
    assert!(
        matches!(err, FormatError::Bzip2 { offset, .. } if offset == (bytes.len() / 2) as u64),
        "{msg}"
    );
    assert!(
        msg.contains("cut.xml.bz2") && msg.contains("offset"),
        "{msg}"
    );
    let left: Vec<_> = fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "an interrupted run left {left:?}");

    // The same for a multistream file cut inside a stream.
    let multi = multistream(&enwiki_xml(), 10);
    let cut = tmp.path().join("cut-multistream.xml.bz2");
    fs::write(&cut, &multi[..multi.len() * 2 / 3]).unwrap();
    let err = run(&[cut], &out, &WikiOptions::default()).unwrap_err();
    // Multistream: the offset is the start of the stream the cut falls in. (Tried: reporting
    // the stream's offset + 1 fails here; `offset > 0` did not.)
    let cut_at = multi.len() * 2 / 3;
    let starts = stream_starts(&enwiki_xml(), 10);
    let failing = *starts.iter().filter(|&&s| s < cut_at).max().unwrap();
    assert!(failing > 0);
    assert!(
        matches!(err, FormatError::Bzip2 { offset, .. } if offset == failing as u64),
        "{err} (the stream starts at {failing})"
    );
    assert!(err.to_string().contains("cut-multistream.xml.bz2"));
}

#[test]
fn truncated_xml_is_an_error_with_offset() {
    let tmp = tempfile::tempdir().unwrap();
    let xml = enwiki_xml();
    // Inside a page's text.
    let path = tmp.path().join("cut.xml");
    fs::write(&path, &xml[..xml.len() / 2]).unwrap();
    let err = run(&[path], &tmp.path().join("o1"), &WikiOptions::default()).unwrap_err();
    // The cut falls inside a page's <text>: the offset is that unclosed start tag's.
    let open_tag = xml[..xml.len() / 2]
        .windows(5)
        .rposition(|w| w == b"<text")
        .unwrap();
    assert!(
        matches!(err, FormatError::Xml { offset, .. } if offset == open_tag as u64),
        "{err} (the <text> tag is at {open_tag})"
    );
    assert!(
        err.to_string().contains("cut.xml") && err.to_string().contains("offset"),
        "{err}"
    );
    // Between pages: no closing </mediawiki>.
    let text = std::str::from_utf8(&xml).unwrap();
    let last_page = text.rfind("<page>").unwrap();
    let path = tmp.path().join("cut2.xml");
    fs::write(&path, &xml[..last_page]).unwrap();
    let err = run(&[path], &tmp.path().join("o2"), &WikiOptions::default()).unwrap_err();
    assert!(err.to_string().contains("truncated XML"), "{err}");
    assert!(!tmp.path().join("o2").join("wiki.manifest.json").exists());
}

#[test]
fn invalid_utf8_page_is_a_counted_skip_or_a_strict_error() {
    let tmp = tempfile::tempdir().unwrap();
    let mut xml = enwiki_xml();
    let text = String::from_utf8(xml.clone()).unwrap();
    let at = text
        .find("Anarchism considers the [[state (polity)|state]]")
        .unwrap();
    xml[at + 3] = 0xFF;
    let path = tmp.path().join("bad-utf8.xml");
    fs::write(&path, &xml).unwrap();
    let outcome = run(
        std::slice::from_ref(&path),
        &tmp.path().join("o"),
        &WikiOptions::default(),
    )
    .unwrap();
    let c = counts(&outcome);
    assert_eq!(c.pages_seen, 206);
    assert_eq!(c.invalid_utf8_pages_skipped, 1);
    assert_eq!(c.errors, 1);
    assert_eq!(c.articles_written, 96);
    let warning = &outcome.summary().warnings[0];
    assert!(
        warning.contains("'Anarchism'") && warning.contains(&format!("offset {}", at + 3)),
        "{warning}"
    );

    let strict = WikiOptions {
        strict: true,
        ..Default::default()
    };
    let err = run(&[path], &tmp.path().join("s"), &strict).unwrap_err();
    assert!(
        matches!(err, FormatError::InvalidUtf8 { offset, .. } if offset == (at + 3) as u64),
        "{err}"
    );
}

#[test]
fn unterminated_template_is_counted_and_leaves_no_residue() {
    let tmp = tempfile::tempdir().unwrap();
    let text = String::from_utf8(enwiki_xml()).unwrap();
    let marker = "Anarchism considers the [[state (polity)|state]] to be undesirable";
    let broken = text.replacen(
        marker,
        &format!("{{{{Infobox broken |name=x\n\n{marker}"),
        1,
    );
    let path = tmp.path().join("unterminated.xml");
    fs::write(&path, broken).unwrap();
    let outcome = run(&[path], &tmp.path().join("o"), &WikiOptions::default()).unwrap();
    let c = counts(&outcome);
    assert_eq!(c.unterminated_markup, 1);
    assert_eq!(c.articles_written, 97);
    let out = output_text(&tmp.path().join("o"), &outcome);
    assert!(!out.contains("{{") && !out.contains("Infobox broken"));
    assert!(
        out.contains(
            "Anarchism considers the state to be undesirable, unnecessary, and harmful.\n"
        )
    );
}

#[test]
fn rerun_is_a_no_op_and_changes_rebuild() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o");
    let first = run(&[require(TABLES)], &out, &WikiOptions::default()).unwrap();
    assert!(matches!(first, Outcome::Ran(_)));
    let second = run(&[require(TABLES)], &out, &WikiOptions::default()).unwrap();
    assert!(matches!(second, Outcome::UpToDate(_)));
    // A deleted output or changed options rebuild.
    fs::remove_file(out.join("wiki_00000.txt")).unwrap();
    assert!(matches!(
        run(&[require(TABLES)], &out, &WikiOptions::default()).unwrap(),
        Outcome::Ran(_)
    ));
    let options = WikiOptions {
        clean: bertkit_format::wiki::CleanOptions { keep_lists: true },
        ..Default::default()
    };
    assert!(matches!(
        run(&[require(TABLES)], &out, &options).unwrap(),
        Outcome::Ran(_)
    ));
}

#[test]
fn max_bytes_splits_at_document_boundaries() {
    let tmp = tempfile::tempdir().unwrap();
    let whole = run(
        &[require(ENWIKI)],
        &tmp.path().join("whole"),
        &WikiOptions::default(),
    )
    .unwrap();
    let out = tmp.path().join("split");
    let options = WikiOptions {
        max_bytes: 300_000,
        ..Default::default()
    };
    let split = run(&[require(ENWIKI)], &out, &options).unwrap();
    let files = &split.summary().outputs;
    assert!(files.len() >= 9, "{} files", files.len());
    for f in files {
        let text = fs::read_to_string(out.join(&f.file)).unwrap();
        assert_eq!(text.len() as u64, f.bytes);
        assert!(
            f.bytes <= 300_000 || f.documents == 1,
            "{} has {} bytes",
            f.file,
            f.bytes
        );
        assert!(text.ends_with("\n\n"));
    }
    assert_eq!(
        output_text(&out, &split),
        output_text(&tmp.path().join("whole"), &whole)
    );
    // The manifest follows the published schema's required fields.
    let schema: serde_json::Value = serde_json::from_str(
        &fs::read_to_string(
            bertkit_test_support::repo_root().join("schemas/format-manifest.schema.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let manifest: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(out.join("wiki.manifest.json")).unwrap()).unwrap();
    for key in schema["required"].as_array().unwrap() {
        assert!(
            manifest.get(key.as_str().unwrap()).is_some(),
            "manifest lacks {key}"
        );
    }
    for key in schema["$defs"]["wikiCounts"]["required"]
        .as_array()
        .unwrap()
    {
        assert!(
            manifest["counts"].get(key.as_str().unwrap()).is_some(),
            "counts lack {key}"
        );
    }
}
