//! URL lists (BookCorpus-style), concurrency with per-host politeness, rank splitting and
//! keep-going on failures, against a local HTTP server on 127.0.0.1 that counts how many
//! requests it serves at once.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bertkit_download::queue::QueueOptions;
use bertkit_download::sources::{
    Registry, SetOptions, download_set, name_from_url, parse_url_list,
};
use bertkit_download::{DownloadError, FetchOptions, Fetched};
use bertkit_stage_io::Ranks;

struct BookServer {
    base: String,
    /// Most requests in flight at once.
    most_at_once: Arc<AtomicUsize>,
    /// Start time of every request.
    starts: Arc<Mutex<Vec<Instant>>>,
}

fn book(n: usize) -> Vec<u8> {
    format!("Book {n}.\n").repeat(2000 + n).into_bytes()
}

/// Serves /books/<n>.txt (slowly, so transfers overlap) and 403 for /books/forbidden.txt.
fn serve_books() -> BookServer {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let in_flight = Arc::new(AtomicUsize::new(0));
    let most_at_once = Arc::new(AtomicUsize::new(0));
    let starts = Arc::new(Mutex::new(Vec::new()));
    let (most, st) = (most_at_once.clone(), starts.clone());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            // The start is taken as the connection is accepted, not in the thread that serves
            // it: a thread's start-up delay would otherwise shift the measured gaps.
            st.lock().unwrap().push(Instant::now());
            let (in_flight, most) = (in_flight.clone(), most.clone());
            std::thread::spawn(move || {
                let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut request = String::new();
                let _ = reader.read_line(&mut request);
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                }
                let path = request.split_whitespace().nth(1).unwrap_or("").to_string();
                std::thread::sleep(Duration::from_millis(60));
                let body = path
                    .strip_prefix("/books/")
                    .and_then(|p| p.strip_suffix(".txt"))
                    .and_then(|n| n.parse::<usize>().ok())
                    .map(book);
                let _ = match body {
                    Some(body) => stream
                        .write_all(
                            format!(
                                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                                body.len()
                            )
                            .as_bytes(),
                        )
                        .and_then(|()| stream.write_all(&body)),
                    None => stream.write_all(
                        b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                    ),
                };
                in_flight.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    BookServer {
        base,
        most_at_once,
        starts,
    }
}

fn registry() -> Registry {
    toml::from_str(
        r#"
        [[source]]
        set = "books"
        url_list = "{url_list}"
        path = "bookcorpus/{name}"
        "#,
    )
    .unwrap()
}

fn options(ranks: Ranks) -> SetOptions {
    SetOptions {
        fetch: FetchOptions {
            retries: 0,
            ..Default::default()
        },
        queue: QueueOptions {
            jobs: 6,
            per_host: 2,
            min_interval: Duration::from_millis(40),
        },
        ranks,
    }
}

#[test]
fn a_url_list_downloads_politely_keeps_going_past_a_403_and_reruns_only_what_failed() {
    let server = serve_books();
    let dir = tempfile::tempdir().unwrap();
    let list = dir.path().join("books.txt");
    let mut text = String::from("# a BookCorpus-style list\n\n");
    for n in 0..8 {
        text.push_str(&format!("{}/books/{n}.txt\n", server.base));
        if n == 3 {
            text.push_str(&format!("{}/books/forbidden.txt\n", server.base));
        }
    }
    std::fs::write(&list, &text).unwrap();
    let vars = HashMap::from([("url_list".to_string(), list.display().to_string())]);
    let out = dir.path().join("out");

    let err = download_set(
        &registry(),
        "books",
        &vars,
        &out,
        None,
        &options(Ranks::single()),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap_err();
    let DownloadError::Incomplete {
        failed,
        total,
        errors,
        ..
    } = &err
    else {
        panic!("{err}");
    };
    assert_eq!((*failed, *total), (1, 9));
    assert!(
        errors[0].contains("forbidden.txt") && errors[0].contains("403"),
        "{err}"
    );
    for n in 0..8 {
        assert_eq!(
            std::fs::read(out.join(format!("bookcorpus/{n}.txt"))).unwrap(),
            book(n)
        );
    }
    assert!(!out.join("bookcorpus/forbidden.txt").exists());
    // Politeness: never more than two at once from the host, starts 40 ms apart. The server
    // sees a start when its accept loop wakes, which a busy machine delays by a few ms for one
    // connection and not the next: gaps down to 20 ms are allowed (unspaced starts, as two
    // at once would be, arrive within a millisecond or two of each other).
    assert!(server.most_at_once.load(Ordering::SeqCst) <= 2);
    let mut starts = server.starts.lock().unwrap().clone();
    starts.sort();
    assert_eq!(starts.len(), 9);
    for pair in starts.windows(2) {
        assert!(
            pair[1] - pair[0] >= Duration::from_millis(20),
            "{:?}",
            pair[1] - pair[0]
        );
    }

    // Without the bad line, a re-run fetches nothing again.
    std::fs::write(
        &list,
        text.lines()
            .filter(|l| !l.contains("forbidden"))
            .collect::<Vec<_>>()
            .join("\n"),
    )
    .unwrap();
    let again = download_set(
        &registry(),
        "books",
        &vars,
        &out,
        None,
        &options(Ranks::single()),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap();
    assert!(again.is_up_to_date(), "nothing to fetch the second time");
    let again = again.into_summary();
    assert_eq!(again.len(), 8);
    assert!(
        again
            .iter()
            .all(|(_, o)| matches!(o, Fetched::AlreadyPresent { .. }))
    );
    assert_eq!(server.starts.lock().unwrap().len(), 9);
}

#[test]
fn ranks_fetch_disjoint_shares_that_cover_the_list() {
    let server = serve_books();
    let dir = tempfile::tempdir().unwrap();
    let list = dir.path().join("books.txt");
    let text: String = (0..7)
        .map(|n| format!("{}/books/{n}.txt\n", server.base))
        .collect();
    std::fs::write(&list, text).unwrap();
    let vars = HashMap::from([("url_list".to_string(), list.display().to_string())]);
    let out = dir.path().join("out");
    let mut seen = Vec::new();
    for rank in 0..3 {
        let ranks = Ranks::new(rank, 3).unwrap();
        let done = download_set(
            &registry(),
            "books",
            &vars,
            &out,
            None,
            &options(ranks),
            &bertkit_stage_io::stage::Silent,
        )
        .unwrap();
        let done = done.into_summary();
        assert!(
            done.iter()
                .all(|(_, o)| matches!(o, Fetched::Downloaded { .. }))
        );
        seen.extend(done.into_iter().map(|(p, _)| p));
    }
    seen.sort();
    let expected: Vec<String> = (0..7).map(|n| format!("bookcorpus/{n}.txt")).collect();
    assert_eq!(seen, expected);
}

#[test]
fn url_list_lines_and_names() {
    let parsed = parse_url_list(
        "https://a.example/x/b%20c.txt  # note\n\nhttps://a.example/y.epub?dl=1 "
            .to_string()
            .as_str(),
        "list",
    )
    .unwrap();
    assert_eq!(parsed.len(), 2);
    assert_eq!(name_from_url(&parsed[0].0).as_deref(), Some("b_20c.txt"));
    assert_eq!(name_from_url(&parsed[1].0).as_deref(), Some("y.epub"));
    assert_eq!(name_from_url("https://a.example/.."), None);
    let digest = "0".repeat(64);
    let parsed = parse_url_list(&format!("https://a/b {digest}"), "list").unwrap();
    assert_eq!(parsed[0].1.as_ref().unwrap().hex, digest);
    let err = parse_url_list("https://a/b zz", "list").unwrap_err();
    assert!(err.to_string().starts_with("list:1:"), "{err}");
    let err = parse_url_list("https://a/b 1 2", "list").unwrap_err();
    assert!(err.to_string().contains("URL [SHA256]"), "{err}");
}

#[test]
fn two_urls_with_one_name_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let list = dir.path().join("books.txt");
    std::fs::write(
        &list,
        "https://a.example/1/book.txt\nhttps://b.example/2/book.txt\n",
    )
    .unwrap();
    let vars = HashMap::from([("url_list".to_string(), list.display().to_string())]);
    let err = download_set(
        &registry(),
        "books",
        &vars,
        dir.path(),
        None,
        &options(Ranks::single()),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("would both be saved as \"book.txt\""),
        "{err}"
    );
}
