//! Seed inputs for each target, cut from the shared data folder (`BERTKIT_SHARED_DATA`) and the
//! repository's own configs: real pages, books, SQuAD articles, GLUE rows, records files. The
//! fuzzers start from them (`make fuzz` writes them under `fuzz/seeds/`), and the replay test
//! runs every target over them, so each parser is also shown to take real input without
//! panicking. Seeds are small (a few KB): libFuzzer mutates small inputs many times faster.

use std::io::{Read, Write};
use std::sync::OnceLock;

use bertkit_records::instances::{Instances, TrainingInstance};
use bertkit_records::parquet_file::write_instances;
use bertkit_test_support::{repo_root, require};

/// The largest seed a target is given, in bytes (a page or a book slice is cut to it).
pub const MAX_SEED_BYTES: usize = 16 * 1024;

/// The seeds of the target called `name` (empty for an unknown name).
pub fn seeds(name: &str) -> Vec<Vec<u8>> {
    match name {
        "wiki_xml" => wiki_xml(),
        "wikitext" => wikitext(),
        "dump_bz2" => dump_bz2(),
        "sentences" => sentences(),
        "books" => books(),
        "wordpiece" => wordpiece(),
        "records_parquet" => records_parquet(),
        "squad_json" => squad_json(),
        "glue_tsv" => glue_tsv(),
        "configs_toml" => configs_toml(),
        "download_text" => download_text(),
        "tf_checkpoint" => tf_checkpoint(),
        "metrics_plot" => metrics_plot(),
        "model_json" => model_json(),
        _ => Vec::new(),
    }
}

/// A shared file's bytes.
fn shared(relative: &str) -> Vec<u8> {
    std::fs::read(require(relative)).unwrap_or_else(|e| panic!("reading {relative}: {e}"))
}

/// A bzip2 file of the shared folder, decompressed (every stream).
fn shared_bz2(relative: &str) -> Vec<u8> {
    let mut out = Vec::new();
    bzip2::read::MultiBzDecoder::new(shared(relative).as_slice())
        .read_to_end(&mut out)
        .unwrap_or_else(|e| panic!("decompressing {relative}: {e}"));
    out
}

/// The enwiki chunk's XML and the table-markup articles' XML.
fn dumps() -> &'static [Vec<u8>; 2] {
    static XML: OnceLock<[Vec<u8>; 2]> = OnceLock::new();
    XML.get_or_init(|| {
        [
            shared_bz2(
                "wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
            ),
            shared_bz2("wikipedia/enwiki-table-markup.xml.bz2"),
        ]
    })
}

/// Every `<page>…</page>` of `xml`, and what comes before the first (the `<mediawiki>` and
/// `<siteinfo>` header).
fn pages(xml: &[u8]) -> (&[u8], Vec<&[u8]>) {
    let find = |from: usize, needle: &[u8]| {
        xml[from..]
            .windows(needle.len())
            .position(|w| w == needle)
            .map(|p| from + p)
    };
    let header_end = find(0, b"<page>").unwrap_or(xml.len());
    let mut out = Vec::new();
    let mut at = header_end;
    while let Some(start) = find(at, b"<page>") {
        let Some(end) = find(start, b"</page>") else {
            break;
        };
        out.push(&xml[start..end + b"</page>".len()]);
        at = end;
    }
    (&xml[..header_end], out)
}

/// Small whole documents: the header, one page of at most [`MAX_SEED_BYTES`], the closing tag.
fn small_documents() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for xml in dumps() {
        let (header, pages) = pages(xml);
        for page in pages {
            if header.len() + page.len() < MAX_SEED_BYTES {
                let mut doc = header.to_vec();
                doc.extend_from_slice(page);
                doc.extend_from_slice(b"\n</mediawiki>\n");
                out.push(doc);
            }
        }
    }
    out
}

/// `<mediawiki>` documents of one small page each, behind a selector byte that varies.
fn wiki_xml() -> Vec<Vec<u8>> {
    small_documents()
        .into_iter()
        .take(64)
        .enumerate()
        .map(|(i, doc)| with_selector(i as u8, &doc))
        .collect()
}

/// The wikitext of pages (XML unescaped once, as the page reader hands it over), cut to
/// [`MAX_SEED_BYTES`] at a character boundary.
fn wikitext() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for xml in dumps() {
        for page in pages(xml).1 {
            let text = String::from_utf8_lossy(page);
            let Some(start) = text.find("<text") else {
                continue;
            };
            let Some(open_end) = text[start..].find('>') else {
                continue;
            };
            let body = &text[start + open_end + 1..];
            let body = &body[..body.find("</text>").unwrap_or(body.len())];
            let unescaped = body
                .replace("&lt;", "<")
                .replace("&gt;", ">")
                .replace("&quot;", "\"")
                .replace("&amp;", "&");
            if unescaped.len() < 64 {
                continue;
            }
            let cut = char_floor(&unescaped, MAX_SEED_BYTES - 1);
            out.push(with_selector(out.len() as u8, &unescaped.as_bytes()[..cut]));
        }
    }
    out.truncate(96);
    out
}

/// Small dumps as `format wiki` meets them: plain XML, one bzip2 stream, and multistream
/// bzip2 (one page a stream, as Wikipedia's multistream files are cut).
///
/// All but one stream use 100 kB blocks (`BZh1`): the decoder clears a block-sized table for
/// every stream it starts (3.6 MB at `BZh9`, which Wikipedia's dumps use), and that clearing
/// was most of an execution's time. The scanner and the decoder take the same paths for every
/// level; one `BZh9` seed keeps the real level in the corpus.
fn dump_bz2() -> Vec<Vec<u8>> {
    let documents = small_documents();
    let mut out = Vec::new();
    for doc in documents.iter().take(8) {
        out.push(doc.clone());
        out.push(bz2(doc));
    }
    if let Some(doc) = documents.first() {
        out.push(bz2_at(doc, bzip2::Compression::best()));
    }
    // Multistream: the header, then each of a few pages, then the closing tag, each its own
    // stream.
    let (header, pages) = pages(&dumps()[0]);
    let small: Vec<&[u8]> = pages
        .into_iter()
        .filter(|p| p.len() < MAX_SEED_BYTES / 4)
        .take(3)
        .collect();
    let mut multi = bz2(header);
    for page in &small {
        multi.extend(bz2(page));
    }
    multi.extend(bz2(b"</mediawiki>\n"));
    out.push(multi);
    out
}

/// `data` as one bzip2 stream of 100 kB blocks.
fn bz2(data: &[u8]) -> Vec<u8> {
    bz2_at(data, bzip2::Compression::fast())
}

/// `data` as one bzip2 stream at `level`.
fn bz2_at(data: &[u8], level: bzip2::Compression) -> Vec<u8> {
    let mut encoder = bzip2::write::BzEncoder::new(Vec::new(), level);
    encoder.write_all(data).expect("writing to memory");
    encoder.finish().expect("writing to memory")
}

/// The shared books.
const BOOKS: [&str; 3] = [
    "gutenberg/austen-emma.txt",
    "gutenberg/chesterton-thursday.txt",
    "gutenberg/melville-moby_dick.txt",
];

/// Paragraphs of the books (blank-line separated, joined into one line) of 40 bytes or more.
fn sentences() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for book in BOOKS {
        let text = String::from_utf8_lossy(&shared(book)).replace('\r', "");
        out.extend(
            text.split("\n\n")
                .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
                .filter(|p| p.len() >= 40 && p.len() < MAX_SEED_BYTES)
                .skip(40)
                .step_by(25)
                .take(16)
                .map(String::into_bytes),
        );
    }
    out
}

/// Each book's opening (the licence header) and end (the licence footer), and a Latin-1
/// version of an opening.
fn books() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for book in BOOKS {
        let bytes = shared(book);
        let head = &bytes[..bytes.len().min(MAX_SEED_BYTES)];
        let tail = &bytes[bytes.len().saturating_sub(MAX_SEED_BYTES)..];
        out.push(head.to_vec());
        out.push(tail.to_vec());
        // The middle of the book with both ends kept, as a short whole book.
        let mut short = head[..head.len() / 2].to_vec();
        short.extend_from_slice(&tail[tail.len() / 2..]);
        out.push(short);
    }
    // Latin-1: é and ç as single bytes.
    let latin1: Vec<u8> = String::from_utf8_lossy(&out[0])
        .chars()
        .map(|c| if (c as u32) < 256 { c as u8 } else { b'?' })
        .chain(b"\ncaf\xe9 gar\xe7on\n".iter().copied())
        .collect();
    out.push(latin1);
    out
}

/// The texts of Google's tokenizer reference (uncased and cased), and lines of the sample
/// text.
fn wordpiece() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let reference =
        String::from_utf8_lossy(&shared("reference/wordpiece_reference.jsonl")).into_owned();
    for (i, line) in reference.lines().enumerate().take(64) {
        let Ok(value) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if let Some(text) = value.get("text").and_then(|t| t.as_str()) {
            let cut = char_floor(text, MAX_SEED_BYTES - 1);
            out.push(with_selector(i as u8, &text.as_bytes()[..cut]));
        }
    }
    let sample = String::from_utf8_lossy(&shared("bert/sample_text.txt")).into_owned();
    for (i, line) in sample
        .lines()
        .filter(|l| !l.is_empty())
        .take(16)
        .enumerate()
    {
        out.push(with_selector(i as u8, line.as_bytes()));
    }
    out
}

/// Records files as the records stage writes them (instances of the sample text's real ids,
/// with and without the vocabulary and parameters in the metadata), in a small vocabulary so
/// that seeds stay small.
fn records_parquet() -> Vec<Vec<u8>> {
    let vocab_text: String = String::from_utf8_lossy(&shared("minilm/vocab.txt"))
        .lines()
        .take(2000)
        .map(|l| format!("{l}\n"))
        .collect();
    let tokenizer = bertkit_tokenizer::FullTokenizer::from_vocab_text(
        std::path::Path::new("vocab.txt"),
        &vocab_text,
        true,
    )
    .expect("the cut vocabulary loads");
    let sample = String::from_utf8_lossy(&shared("bert/sample_text.txt")).into_owned();
    let lines: Vec<Vec<u32>> = sample
        .lines()
        .filter(|l| !l.is_empty())
        .take(24)
        .map(|l| tokenizer.tokenize_ids(l))
        .collect();
    let instances: Vec<TrainingInstance> = lines
        .chunks(2)
        .enumerate()
        .map(|(i, pair)| {
            let first = &pair[0][..pair[0].len().min(30)];
            let second = pair.get(1).map_or(&[][..], |s| &s[..s.len().min(30)]);
            let mut input_ids = vec![101];
            input_ids.extend_from_slice(first);
            input_ids.push(102);
            input_ids.extend_from_slice(second);
            input_ids.push(102);
            let masked_lm_positions = vec![1, (first.len() as u32).max(1)];
            let masked_lm_ids = masked_lm_positions
                .iter()
                .map(|&p| input_ids[p as usize])
                .collect();
            TrainingInstance {
                first_segment_len: first.len() + 2,
                input_ids,
                is_random_next: i % 2 == 1,
                masked_lm_positions,
                masked_lm_ids,
            }
        })
        .collect();
    let parameters = r#"{"instances":{"max_seq_length":128}}"#;
    let metadata_sets: [Vec<(String, String)>; 2] = [
        vec![
            ("bertkit.parameters".into(), parameters.into()),
            ("bertkit.vocab_sha256".into(), "0".repeat(64)),
            (
                bertkit_records::reader::VOCAB_KEY.into(),
                vocab_text.clone(),
            ),
        ],
        vec![],
    ];
    let dir = std::env::temp_dir().join(format!("bertkit-fuzz-seeds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("the temporary folder is writable");
    let mut out = Vec::new();
    for (m, metadata) in metadata_sets.iter().enumerate() {
        for take in [1, instances.len()] {
            let path = dir.join(format!("records-{m}-{take}.parquet"));
            write_instances(&path, &Instances::from_owned(&instances[..take]), metadata)
                .expect("writing a records seed");
            out.push(std::fs::read(&path).expect("reading it back"));
            let _ = std::fs::remove_file(&path);
        }
    }
    let _ = std::fs::remove_dir(&dir);
    out
}

/// SQuAD files of one article's first paragraph each: v1.1 (the dev set) and v2.0 (with
/// unanswerable questions), behind every selector (training or prediction, v1.1 or v2.0).
fn squad_json() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for (file, version) in [
        ("squad/dev-v1.1.json", "1.1"),
        ("squad/cs224n-dev-v2.0-subset.json", "v2.0"),
    ] {
        let json: serde_json::Value =
            serde_json::from_slice(&shared(file)).expect("the shared SQuAD file parses");
        let articles = json["data"].as_array().expect("a data array");
        for (i, article) in articles.iter().take(6).enumerate() {
            let mut article = article.clone();
            if let Some(paragraphs) = article["paragraphs"].as_array_mut() {
                paragraphs.truncate(1);
                if let Some(qas) = paragraphs[0]["qas"].as_array_mut() {
                    qas.truncate(4);
                }
            }
            let one = serde_json::json!({ "version": version, "data": [article] });
            let bytes = serde_json::to_vec(&one).expect("JSON serialises");
            out.push(with_selector(i as u8, &bytes));
        }
    }
    out
}

/// The first rows (header included) of each GLUE task's train and dev files, behind the
/// selector that reads them as that task.
fn glue_tsv() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for (selector, task) in [(0u8, "MRPC"), (1, "CoLA"), (2, "SST-2")] {
        for file in ["train.tsv", "dev.tsv"] {
            let text = shared(&format!("glue/{task}/{file}"));
            let rows: Vec<&[u8]> = text.split(|&b| b == b'\n').take(24).collect();
            out.push(with_selector(selector, &rows.join(&b'\n')));
        }
    }
    out
}

/// The repository's pipeline and run configs and the download registry, each behind the
/// selector that reads it as its kind.
fn configs_toml() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let dir = repo_root().join("pipelines");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    for path in files {
        let bytes = std::fs::read(&path).expect("a config reads");
        let text = String::from_utf8_lossy(&bytes);
        // The registry lists sources; pipelines have steps; run configs the rest.
        let selector = if text.contains("[[source]]") {
            2
        } else if text.contains("\n[download]") || text.contains("\n[format]") {
            1
        } else {
            0
        };
        for s in [selector, (selector + 1) % 3, (selector + 2) % 3] {
            out.push(with_selector(s, &bytes));
        }
    }
    out
}

/// Checksum files (sha256sum, sha1sum and md5sum layouts, as Wikimedia and others publish
/// them) of the shared files, URL lists, and `Content-Range` headers.
fn download_text() -> Vec<Vec<u8>> {
    use sha2::Digest;
    let names = [
        "wikipedia/enwiki-table-markup.xml.bz2",
        "glue/MRPC/dev.tsv",
        "glue/CoLA/dev.tsv",
        "bert/sample_text.txt",
    ];
    let mut sha256 = String::new();
    let mut sha1 = String::new();
    let mut md5 = String::new();
    for name in names {
        let bytes = shared(name);
        let file = name.rsplit('/').next().expect("a file name");
        sha256.push_str(&format!("{}  {file}\n", hex(&sha2::Sha256::digest(&bytes))));
        sha1.push_str(&format!("{} *{file}\n", hex(&sha1::Sha1::digest(&bytes))));
        md5.push_str(&format!("{}  {file}\n", hex(&md5::Md5::digest(&bytes))));
    }
    let urls = "# sources, one a line\n\
                https://dumps.example.org/enwiki/latest/enwiki-latest-pages-articles-multistream.xml.bz2\n\
                \n\
                https://books.example.org/files/2701/2701-0.txt # Moby Dick\n\
                http://mirror.example.net/path/with%20space/file.tar.gz 0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef\n";
    let ranges = "bytes 0-1023/4096\nbytes 1024-4095/4096\nbytes 7-7/*\nbytes 100-99/200\n";
    vec![
        sha256.into_bytes(),
        sha1.into_bytes(),
        md5.into_bytes(),
        urls.as_bytes().to_vec(),
        ranges.as_bytes().to_vec(),
    ]
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `selector` then `data`.
fn with_selector(selector: u8, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + 1);
    out.push(selector);
    out.extend_from_slice(data);
    out
}

/// The largest char boundary of `text` at or below `at`.
fn char_floor(text: &str, at: usize) -> usize {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// The fixture's TensorFlow-written index, an index this crate's writer makes, and each cut
/// short (a truncated download).
fn tf_checkpoint() -> Vec<Vec<u8>> {
    let fixture = repo_root().join("crates/model/tests/fixtures/google_tf/bert_model.ckpt.index");
    let tensorflow =
        std::fs::read(&fixture).unwrap_or_else(|e| panic!("{}: {e}", fixture.display()));
    let dir = std::env::temp_dir().join(format!("bertkit-seeds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("the temporary folder is writable");
    let prefix = dir.join("small.ckpt");
    let mut writer = bertkit_tf_checkpoint::Writer::create(&prefix).expect("a writable folder");
    writer
        .add_f32("bert/pooler/dense/bias", &[4], &[0.5, -1.0, 2.0, 0.0])
        .expect("a tensor");
    writer
        .add(
            "global_step",
            bertkit_tf_checkpoint::DType::I64,
            &[],
            &7i64.to_le_bytes(),
        )
        .expect("a tensor");
    writer.finish().expect("written");
    let ours = std::fs::read(bertkit_tf_checkpoint::index_path(&prefix)).expect("written");
    let _ = std::fs::remove_dir_all(&dir);
    // Raw files behind an even selector.
    let raw = |bytes: &[u8]| [&[0u8][..], bytes].concat();
    let mut seeds = vec![raw(&tensorflow), raw(&ours)];
    seeds.push(raw(&tensorflow[..tensorflow.len() / 2]));
    seeds.push(raw(&ours[..ours.len() - 9]));
    // The fixture's rows (key 0xff value 0xff …) behind an odd one: the header and a few
    // entries, and all of them.
    let rows = bertkit_tf_checkpoint::index_rows(&tensorflow).expect("the fixture's index reads");
    for take in [4, rows.len()] {
        let mut seed = vec![1u8];
        for (i, (key, value)) in rows.iter().take(take).enumerate() {
            if i > 0 {
                seed.push(0xff);
            }
            seed.extend_from_slice(key);
            seed.push(0xff);
            seed.extend_from_slice(value);
        }
        seeds.push(seed);
    }
    seeds
}

/// `metrics.jsonl` as pre-training writes it (held-out rows every other step, a learning rate
/// warming up) and as fine-tuning does, a flat curve, and a line cut short.
fn metrics_plot() -> Vec<Vec<u8>> {
    let pretraining: String = (1..=6)
        .map(|step| {
            let mut row = serde_json::json!({
                "step": step, "loss": 11.0 - step as f64 * 0.4, "mlm_loss": 10.3,
                "nsp_loss": 0.69, "mlm_accuracy": 0.01 * step as f64, "nsp_accuracy": 0.5,
                "lr": 1e-4 * step as f64, "grad_norm": 1.5, "seq_per_s": 80.0,
            });
            if step % 2 == 0 {
                row["eval_loss"] = serde_json::json!(10.9);
                row["eval_mlm_accuracy"] = serde_json::json!(0.02);
            }
            format!("{row}\n")
        })
        .collect();
    let finetuning: String = (1..=4)
        .map(|step| {
            format!(
                "{{\"step\":{step},\"loss\":{},\"lr\":2e-5}}\n",
                0.7 / step as f64
            )
        })
        .collect();
    let flat = "{\"step\":1,\"loss\":0}\n{\"step\":2,\"loss\":1e-323}\n".to_string();
    let cut = pretraining[..pretraining.len() / 2].to_string();
    [pretraining, finetuning, flat, cut]
        .map(String::into_bytes)
        .to_vec()
}

/// MiniLM's `config.json` and `tokenizer_config.json` from the shared folder, and a
/// checkpoint's `checksums.json` (digests of files beside it, one absent), each behind its
/// selector.
fn model_json() -> Vec<Vec<u8>> {
    use sha2::Digest;
    let record = serde_json::json!({
        "config.json": hex(&sha2::Sha256::digest(b"{}")),
        "state.json": hex(&sha2::Sha256::digest(b"{\"step\": 1}")),
    });
    vec![
        with_selector(0, &shared("minilm/config.json")),
        with_selector(1, &shared("minilm/tokenizer_config.json")),
        with_selector(2, record.to_string().as_bytes()),
        with_selector(2, b"{}"),
    ]
}
