#!/usr/bin/env python3
"""A diverse benchmark corpus at any size, laid out as a mirror `bertkit pipeline` downloads from.

Repeating the shared enwiki chunk makes a big input with the chunk's ~50,000 distinct words, which
flatters every per-word cache. This generator keeps what is real about the chunk and the books
and replaces their words:

- **Markup**: every page is a real page of the shared chunk (templates, tables, refs, links,
  entities, headings, categories all kept), cut after a section heading to a length drawn from
  a log-normal (median 5 kB of wikitext, sigma 1.3: Wikipedia's many stubs and few long
  articles) and never past the end of the real page. Redirect pages come at the chunk's own
  rate (100 of 206) with their real `{{R from …}}` tails.
- **Words**: every letter run of the page text is replaced by a word drawn from a Zipfian
  distribution over `--forms` distinct forms, keeping the replaced word's case (capitalised,
  lower) and leaving markup alone (tag and entity names, namespace prefixes, magic words,
  upper-case acronyms, image options). Ranks 1..3000 take the real words of the formatted chunk
  and the three books at their measured frequencies ("the" 5.8%); from rank 3001 on, the real
  words not in the head, then pseudo-words from a letter-trigram model of the real words (3% of
  them with a Latin diacritic, 0.5% Cyrillic, 0.3% CJK), with probability falling as
  rank^-1.5. Digit runs become random digits of the same length. The type/token curve this
  gives is the real chunk's where they overlap (~50,000 types at 0.8 M tokens) and grows to
  millions of types (see corpus-stats.json and BENCHMARKS.md).
- **Layout**: Wikipedia's multistream `pages-articles-multistream.xml.bz2` (the siteinfo
  header in its own bz2 stream, then 100 pages a stream, `</mediawiki>` last) with its
  `-index.txt.bz2` and a `sha1sums.txt`; books as Project Gutenberg-style text files (licence
  header and footer) of log-normal size around 500 kB, `--books-fraction` of the XML's size in
  all; the bert-base-uncased vocabulary; and a source registry + pipeline config that run
  `bertkit pipeline` on them as `make data` runs on the real dumps.

With --real-words the pages and books keep their own words: the repeated-chunk baseline, with
the same markup, lengths and layout.

Deterministic: page chunk k and book i depend only on --seed and k (or i), whatever the worker
count. Writes into OUT: mirror/ (wikipedia/, books/, vocab/), registry.toml, pipeline.toml
(output OUT/run), corpus-stats.json.

Usage: scale_corpus.py --shared ../shared/data --bertkit target/release/bertkit --out DIR --gb 10
"""
import argparse
import bz2
import collections
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

CHUNK = "wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
BOOKS = ["austen-emma.txt", "chesterton-thursday.txt", "melville-moby_dick.txt"]
DATE = "bench"
PAGES_PER_STREAM = 100
HEAD_RANKS = 3000
TAIL_EXPONENT = 1.5
FORM_BYTES = 32
# Markup words that must stay what they are: the formatter recognises them by name.
KEEP = {
    "thumb", "thumbnail", "left", "right", "center", "upright", "px", "frame", "frameless",
    "border", "none", "alt", "nbsp", "ndash", "mdash", "amp", "quot", "lt", "gt", "http",
    "https", "www", "ref", "br", "references",
}
LOWER, CAPITAL, DIGITS = 0, 1, 2
SLOT = re.compile(r"\w+")


# --- words --------------------------------------------------------------------------------------

def real_words(bertkit, shared):
    """The formatted chunk's and the books' words, lower-cased, by count: (forms, counts)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([bertkit, "format", "wiki", "-q", "-i", os.path.join(shared, CHUNK),
                        "-o", tmp], check=True, stdout=subprocess.DEVNULL)
        text = "".join(open(os.path.join(tmp, f), encoding="utf-8").read()
                       for f in sorted(os.listdir(tmp)) if f.endswith(".txt"))
    for b in BOOKS:
        text += open(os.path.join(shared, "gutenberg", b), encoding="utf-8").read()
    counts = collections.Counter(re.findall(r"[^\W\d_]+", text.lower()))
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    ranked = [(w, c) for w, c in ranked if len(w.encode()) < FORM_BYTES]
    return [w for w, _ in ranked], np.array([c for _, c in ranked], dtype=np.float64)


def pseudo_words(real, count, rng):
    """`count` distinct letter-trigram pseudo-words not among `real` (a few non-Latin)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    types = [w for w in real if w.isascii() and w.isalpha() and len(w) >= 3]
    # Transitions (a, b) -> c over "^^word$", '^' = 26 (start), '$' = 26 (end, as a next letter).
    table = np.ones((27, 27, 27), dtype=np.float64) * 1e-3
    for w in types:
        s = [26, 26] + [letters.index(ch) for ch in w] + [26]
        for a, b, c in zip(s, s[1:], s[2:]):
            table[a, b, c] += 1.0
    table[:, :, 26] *= 0.9  # a little longer than the real types: rare words are long
    cdf = np.cumsum(table, axis=2)
    cdf /= cdf[:, :, -1:]
    out, seen = [], set(real)
    while len(out) < count:
        batch = min(1 << 20, max(1024, int((count - len(out)) * 1.2)))
        a = np.full(batch, 26)
        b = np.full(batch, 26)
        chars = np.full((batch, FORM_BYTES - 8), 32, dtype=np.uint8)
        alive = np.ones(batch, dtype=bool)
        for pos in range(FORM_BYTES - 8):
            u = rng.random(batch)
            rows = cdf[a, b]
            nxt = (u[:, None] > rows).sum(axis=1)
            nxt = np.minimum(nxt, 26)
            end = (nxt == 26) & (pos >= 3)
            nxt = np.where((nxt == 26) & (pos < 3), rng.integers(0, 26, batch), nxt)
            alive &= ~end
            chars[alive, pos] = (nxt[alive] + 97).astype(np.uint8)
            a, b = b, nxt
        words = [bytes(r).rstrip(b" ").decode() for r in chars]
        for w in words:
            if w not in seen:
                seen.add(w)
                out.append(w)
                if len(out) == count:
                    break
    # Some forms in other scripts, as Wikipedia's names and loanwords are.
    marks = dict(zip("aeiouncsz", "áéíóüñçšž"))
    cyrillic = dict(zip(letters, "абцдефгхийклмнопярстуввхыз"))
    kind = rng.random(count)
    for i in np.nonzero(kind < 0.038)[0]:
        w = out[i]
        if kind[i] < 0.03:
            j = int(rng.integers(len(w)))
            out[i] = w[:j] + marks.get(w[j], w[j]) + w[j + 1:]
        elif kind[i] < 0.035:
            out[i] = "".join(cyrillic[ch] for ch in w)
        else:
            out[i] = "".join(chr(0x4E00 + int(x)) for x in rng.integers(0, 20000, 2 + len(w) % 3))
    return out


def cached_pseudo_words(real, args):
    """pseudo_words for these real words, seed and count, from --vocab-cache when it has them
    (making 30 M takes minutes; the forms depend only on the three)."""
    count = max(0, args.forms - len(real))
    if count == 0:
        return []
    key = hashlib.sha256(json.dumps([real, args.seed, count]).encode()).hexdigest()[:16]
    path = os.path.join(args.vocab_cache, f"pseudo-words-{key}.txt") if args.vocab_cache else None
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read().split("\n")
    words = pseudo_words(real, count, np.random.default_rng([args.seed, 0]))
    if path:
        os.makedirs(args.vocab_cache, exist_ok=True)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write("\n".join(words))
        os.replace(path + ".tmp", path)
    return words


class Vocabulary:
    """Ranked forms (fixed-width UTF-8) and the sampler over them."""

    def __init__(self, forms, head_counts, seed):
        self.forms = np.array([f.encode() for f in forms], dtype=f"S{FORM_BYTES}")
        head = head_counts[:HEAD_RANKS] / head_counts.sum()
        self.head_cdf = np.cumsum(head)
        self.head_mass = float(self.head_cdf[-1])
        self.seed = seed

    def __len__(self):
        return len(self.forms)

    def sample(self, rng, n):
        """`n` ranks (0-based): the head at its real frequencies, the tail as rank^-1.5."""
        u = rng.random(n)
        ranks = np.searchsorted(self.head_cdf, u, side="right")
        tail = u >= self.head_mass
        if tail.any():
            v = (u[tail] - self.head_mass) / (1.0 - self.head_mass)
            one = 1.0 - TAIL_EXPONENT
            lo, hi = float(HEAD_RANKS + 1) ** one, float(len(self.forms) + 1) ** one
            r = (lo + v * (hi - lo)) ** (1.0 / one)
            ranks[tail] = np.minimum(r.astype(np.int64) - 1, len(self.forms) - 1)
        return ranks


# --- skeletons ----------------------------------------------------------------------------------

class Skeleton:
    """A text whose word slots are to be filled: pieces around slots, slot kinds, digit lengths."""

    def __init__(self, text):
        text = text.decode()
        self.pieces, kinds, digits = [], [], []
        last = 0
        for m in SLOT.finditer(text):
            word = m.group()
            s, e = m.span()
            if not keep(text, s, e, word):
                self.pieces.append(text[last:s].encode())
                if word.isdigit():
                    kinds.append(DIGITS)
                    digits.append(len(word))
                else:
                    kinds.append(CAPITAL if word[0].isupper() else LOWER)
                    digits.append(0)
                last = e
        self.pieces.append(text[last:].encode())
        self.original = text.encode()
        self.kinds = np.array(kinds, dtype=np.int8)
        self.digits = np.array(digits, dtype=np.int8)
        self.length = len(text)


def keep(text, s, e, word):
    """Whether a word of the skeleton stays: markup, acronyms, mixed letters and digits."""
    if word.isdigit():
        return False
    if "_" in word or not word.isalpha():
        return True  # 1990s, 45th, magic words
    if len(word) > 1 and word.isupper():
        return True  # acronyms, #REDIRECT
    if word.lower() in KEEP:
        return True
    if text[s - 1:s] in ("&", "#") or text[max(0, s - 4):s] in ("&lt;", "amp;") \
            or text[max(0, s - 5):s] == "&lt;/":
        return True
    return text[e:e + 1] in (":", "=")


def join_skeletons(parts):
    """One skeleton from consecutive ones (adjacent edge pieces merged)."""
    pieces, kinds, digits = [], [], []
    for p in parts:
        if pieces:
            pieces[-1] = pieces[-1] + p.pieces[0]
            pieces.extend(p.pieces[1:])
        else:
            pieces.extend(p.pieces)
        kinds.append(p.kinds)
        digits.append(p.digits)
    return pieces, np.concatenate(kinds), np.concatenate(digits)


def fill(parts, vocab, rng, seen):
    """The text of consecutive skeletons with every slot filled (the drawn ranks are added to
    `seen`), or their real text with --real-words; and the number of words drawn."""
    if STATE["real_words"]:
        return b"".join(p.original for p in parts), 0
    pieces, kinds, digits = join_skeletons(parts)
    n = len(kinds)
    if n == 0:
        return pieces[0], 0
    ranks = vocab.sample(rng, n)
    words = vocab.forms[ranks].tolist()
    for i in np.nonzero(kinds == CAPITAL)[0].tolist():
        w = words[i]
        words[i] = w[:1].upper() + w[1:]
    number_slots = np.nonzero(kinds == DIGITS)[0]
    if len(number_slots):
        values = rng.integers(0, 10**9, len(number_slots))
        for i, v, width in zip(number_slots.tolist(), values.tolist(), digits[number_slots].tolist()):
            words[i] = str(v % 10**width).zfill(width).encode()
        seen.append(ranks[kinds != DIGITS])
    else:
        seen.append(ranks)
    out = [b""] * (2 * n + 1)
    out[0::2] = pieces
    out[1::2] = words
    return b"".join(out), n - len(number_slots)


def parse_chunk(shared):
    """The chunk's header, footer and pages: (head, tail, articles, redirects)."""
    xml = bz2.open(os.path.join(shared, CHUNK)).read()
    first = xml.index(b"<page>")
    last = xml.rindex(b"</page>") + len(b"</page>")
    head, tail = xml[:first], xml[last:].strip() + b"\n"
    articles, redirects = [], []
    for page in re.findall(rb"<page>.*?</page>", xml[first:last], re.S):
        ns = re.search(rb"<ns>(\d+)</ns>", page).group(1)
        text = re.search(rb"<text[^>]*>(.*?)</text>", page, re.S).group(1)
        if ns != b"0" or not text:
            continue
        if b"<redirect" in page:
            redirects.append(text[text.index(b"]]") + 2:] if b"]]" in text else b"")
        else:
            # Sections start at a line beginning with '='.
            cuts = [0] + [m.start() + 1 for m in re.finditer(rb"\n=", text)] + [len(text)]
            articles.append([Skeleton(text[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a])
    return head, tail, articles, redirects


# --- the wiki dump -------------------------------------------------------------------------------

STATE = {}


def title_of(vocab, rng):
    words = vocab.forms[vocab.sample(rng, int(rng.integers(1, 4)))].tolist()
    return b" ".join(w[:1].upper() + w[1:] for w in words)


def make_pages(chunk):
    """Pages [chunk·100, chunk·100 + 100): (xml, [(id, title)], tokens, drawn ranks)."""
    vocab, articles, redirects = STATE["vocab"], STATE["articles"], STATE["redirects"]
    rng = np.random.default_rng([vocab.seed, 1, chunk])
    out, index, tokens, seen = [], [], 0, []
    redirect_rate = len(redirects) / (len(redirects) + len(articles))
    for k in range(PAGES_PER_STREAM):
        page_id = 10 + chunk * PAGES_PER_STREAM + k
        title = title_of(vocab, rng)
        if rng.random() < redirect_rate:
            target = title_of(vocab, rng)
            text = b"#REDIRECT [[" + target + b"]]" + redirects[int(rng.integers(len(redirects)))]
            redirect = b'    <redirect title="' + target + b'" />\n'
        else:
            sections = articles[int(rng.integers(len(articles)))]
            want = rng.lognormal(np.log(5000.0), 1.3)
            take, size = 1, sections[0].length
            while take < len(sections) and size + sections[take].length <= want:
                size += sections[take].length
                take += 1
            text, n = fill(sections[:take], vocab, rng, seen)
            tokens += n
            redirect = b""
        out.append(
            b"  <page>\n    <title>" + title + b"</title>\n    <ns>0</ns>\n    <id>%d</id>\n" % page_id
            + redirect
            + b"    <revision>\n      <id>%d</id>\n      <timestamp>2024-01-01T00:00:00Z</timestamp>\n"
            % (page_id * 7 + 3)
            + b"      <model>wikitext</model>\n      <format>text/x-wiki</format>\n"
            + b'      <text bytes="%d" xml:space="preserve">' % len(text) + text + b"</text>\n"
            + b"    </revision>\n  </page>\n"
        )
        index.append((page_id, title))
    xml = b"".join(out)
    ranks = np.unique(np.concatenate(seen)) if seen else np.zeros(0, dtype=np.int64)
    return bz2.compress(xml, 9), len(xml), index, tokens, ranks.astype(np.int32)


def make_book(i):
    """Book i: (text, tokens, drawn ranks)."""
    vocab, books = STATE["vocab"], STATE["books"]
    rng = np.random.default_rng([vocab.seed, 2, i])
    paragraphs = books[i % len(books)]
    want = rng.lognormal(np.log(500_000.0), 0.6)
    start = int(rng.integers(len(paragraphs)))
    parts, size = [], 0
    while size < want:
        p = paragraphs[(start + len(parts)) % len(paragraphs)]
        parts.append(p)
        size += p.length
    seen = []
    body, tokens = fill(parts, vocab, rng, seen)
    title = title_of(vocab, rng).decode()
    author = title_of(vocab, rng).decode()
    text = (f"\ufeffThe Project Gutenberg eBook of {title}\n\nAuthor: {author}\n\nRelease date: 2024\n\n"
            f"*** START OF THE PROJECT GUTENBERG EBOOK {title.upper()} ***\n\n").encode() + body + (
            f"\n\n*** END OF THE PROJECT GUTENBERG EBOOK {title.upper()} ***\n\n"
            "A benchmark book: its licence text is left out.\n").encode()
    ranks = np.unique(np.concatenate(seen)) if seen else np.zeros(0, dtype=np.int64)
    return text, tokens, ranks.astype(np.int32)


# --- main ---------------------------------------------------------------------------------------

class Types:
    """Distinct ranks drawn so far, and the type/token curve at powers of 2 of tokens."""

    def __init__(self, size):
        self.seen = np.zeros(size, dtype=bool)
        self.types = 0
        self.tokens = 0
        self.curve = []
        self.next_point = 1024

    def add(self, tokens, ranks):
        fresh = ranks[~self.seen[ranks]]
        self.seen[fresh] = True
        self.types += len(fresh)
        self.tokens += tokens
        if self.tokens >= self.next_point:
            self.curve.append([self.tokens, self.types])
            while self.next_point <= self.tokens:
                self.next_point *= 2


def ordered(pool, fn, items, workers):
    """fn over items in order, at most 4 per worker in flight (items may be endless)."""
    pending = collections.deque()
    items = iter(items)
    while True:
        while len(pending) < 4 * workers:
            try:
                pending.append(pool.submit(fn, next(items)))
            except StopIteration:
                break
        if not pending:
            return
        yield pending.popleft().result()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", required=True, help="the shared data folder (../shared/data)")
    ap.add_argument("--bertkit", required=True, help="the bertkit binary (formats the real chunk)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--gb", type=float, required=True, help="XML size in GB (1e9 bytes)")
    ap.add_argument("--books-fraction", type=float, default=0.15,
                    help="book text as a fraction of the XML's size")
    ap.add_argument("--forms", type=int, default=30_000_000, help="distinct word forms")
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--vocab-cache", help="a folder keeping the pseudo-words between runs")
    ap.add_argument("--real-words", action="store_true",
                    help="keep the real pages' and books' own words (the repeated-chunk baseline: "
                         "same markup and lengths, the chunk's ~50,000 words)")
    args = ap.parse_args()
    started = time.time()
    mirror = os.path.join(args.out, "mirror")
    for d in ("wikipedia", "books", "vocab"):
        os.makedirs(os.path.join(mirror, d), exist_ok=True)

    real, counts = real_words(args.bertkit, args.shared)
    forms = real + ([] if args.real_words else cached_pseudo_words(real, args))
    vocab = Vocabulary(forms, counts, args.seed)
    head, tail, articles, redirects = parse_chunk(args.shared)
    books = []
    for b in BOOKS:
        text = open(os.path.join(args.shared, "gutenberg", b), "rb").read()
        text = text[text.index(b"\n") + 1:]  # the "[Title by Author]" line
        books.append([Skeleton(p + b"\n\n") for p in re.split(rb"\n\s*\n", text) if p.strip()])
    STATE.update(vocab=vocab, articles=articles, redirects=redirects, books=books,
                 real_words=args.real_words)
    print(f"{len(forms):,} forms ({len(real):,} real), {len(articles)} article and "
          f"{len(redirects)} redirect skeletons, {time.time() - started:.0f} s", flush=True)

    target = int(args.gb * 1e9)
    dump = os.path.join(mirror, "wikipedia", f"enwiki-{DATE}-pages-articles-multistream.xml.bz2")
    index_path = dump.replace(".xml.bz2", "-index.txt.bz2")
    wiki_types, book_types = Types(len(forms)), Types(len(forms))
    all_types = Types(len(forms))
    xml_bytes = pages = streams = 0
    with ProcessPoolExecutor(args.workers) as pool:
        with open(dump + ".tmp", "wb") as f, bz2.open(index_path + ".tmp", "wb") as idx:
            f.write(bz2.compress(head, 9))
            xml_bytes += len(head)
            streams += 1
            chunk = 0
            for packed, size, entries, tokens, ranks in ordered(
                    pool, make_pages, _count(), args.workers):
                offset = f.tell()
                f.write(packed)
                for page_id, title in entries:
                    idx.write(b"%d:%d:%s\n" % (offset, page_id, title))
                wiki_types.add(tokens, ranks)
                all_types.add(tokens, ranks)
                xml_bytes += size
                pages += len(entries)
                streams += 1
                chunk += 1
                if chunk % 1000 == 0:
                    print(f"  {xml_bytes / 1e9:.2f} GB of XML, {pages:,} pages, "
                          f"{wiki_types.types:,} types, {time.time() - started:.0f} s", flush=True)
                if xml_bytes + len(tail) >= target:
                    break
            f.write(bz2.compress(tail, 9))
            xml_bytes += len(tail)
            streams += 1
        os.replace(dump + ".tmp", dump)
        os.replace(index_path + ".tmp", index_path)

        book_target = int(target * args.books_fraction)
        book_bytes = book_count = 0
        for text, tokens, ranks in ordered(pool, make_book, _count(), args.workers):
            book_count += 1
            with open(os.path.join(mirror, "books", f"book-{book_count}.txt"), "wb") as f:
                f.write(text)
            book_bytes += len(text)
            book_types.add(tokens, ranks)
            all_types.add(tokens, ranks)
            if book_bytes >= book_target:
                break

    shutil.copy(os.path.join(args.shared, "minilm", "vocab.txt"), os.path.join(mirror, "vocab", "vocab.txt"))
    sums = []
    for path in (dump, index_path):
        h = hashlib.sha1()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
        sums.append(f"{h.hexdigest()}  {os.path.basename(path)}")
    with open(os.path.join(mirror, "wikipedia", f"enwiki-{DATE}-sha1sums.txt"), "w") as f:
        f.write("\n".join(sums) + "\n")
    write_configs(args.out, book_count)

    stats = {
        "seed": args.seed, "gb": args.gb, "real_words": args.real_words, "forms": len(forms), "real_forms": len(real),
        "head_ranks": HEAD_RANKS, "tail_exponent": TAIL_EXPONENT,
        "wiki": {"xml_bytes": xml_bytes, "bz2_bytes": os.path.getsize(dump), "pages": pages,
                 "streams": streams, "word_tokens": wiki_types.tokens, "types": wiki_types.types,
                 "curve": wiki_types.curve},
        "books": {"files": book_count, "bytes": book_bytes, "word_tokens": book_types.tokens,
                  "types": book_types.types},
        "all": {"word_tokens": all_types.tokens, "types": all_types.types, "curve": all_types.curve},
        "seconds": round(time.time() - started, 1),
    }
    with open(os.path.join(args.out, "corpus-stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    print(f"{xml_bytes / 1e9:.2f} GB of XML ({stats['wiki']['bz2_bytes'] / 1e9:.2f} GB bz2), {pages:,} pages, "
          f"{book_count:,} books ({book_bytes / 1e9:.2f} GB); {all_types.tokens:,} word tokens, "
          f"{all_types.types:,} distinct forms; {stats['seconds']:.0f} s")


def _count():
    k = 0
    while True:
        yield k
        k += 1


def write_configs(out, book_count):
    """The registry and the pipeline config: `make data`'s stages and parameters on the mirror."""
    ids = ", ".join(str(i) for i in range(1, book_count + 1))
    with open(os.path.join(out, "registry.toml"), "w") as f:
        f.write(f"""# The benchmark corpus's sources: files of the mirror only (empty urls).
[[source]]
set = "wikipedia"
url = ""
path = "wikipedia/enwiki-{{date}}-pages-articles-multistream.xml.bz2"
checksum_file = {{ url = "", path = "wikipedia/enwiki-{{date}}-sha1sums.txt", algorithm = "sha1" }}

[[source]]
set = "wikipedia"
url = ""
path = "wikipedia/enwiki-{{date}}-pages-articles-multistream-index.txt.bz2"
checksum_file = {{ url = "", path = "wikipedia/enwiki-{{date}}-sha1sums.txt", algorithm = "sha1" }}

[[source]]
set = "books"
url = ""
path = "books/book-{{id}}.txt"
ids = [{ids}]

[[source]]
set = "vocab"
url = ""
path = "vocab/vocab.txt"
""")
    with open(os.path.join(out, "pipeline.toml"), "w") as f:
        f.write(f"""# make data's stages and parameters (pipelines/data.toml) on the benchmark mirror.
output = "{os.path.join(os.path.abspath(out), 'run')}"

[download]
sets = ["wikipedia", "books", "vocab"]
vars = {{ date = "{DATE}" }}

[format]
wiki = ["wikipedia/enwiki-{DATE}-pages-articles-multistream.xml.bz2"]
books = ["books"]

[shard]
num_train_shards = 256
num_test_shards = 16
test_fraction = 0.1
seed = 12345
compress = "zstd"

[records]
vocab = "vocab/vocab.txt"
dupe_factor = 5
seed = 12345
phases = [1, 2]
""")


if __name__ == "__main__":
    sys.exit(main())
