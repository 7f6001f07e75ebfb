#!/usr/bin/env python3
"""Builds the inputs of bench/format-wiki.sh from the real enwiki chunk.

Writes into OUT_DIR:
  enwiki.xml                        the chunk, decompressed (6.1 MB)
  enwiki-xN.xml                     the chunk's 206 pages repeated N times in one <mediawiki>
                                    (long enough to time without start-up noise)
  enwiki-xN.xml.bz2                 the same, one bzip2 stream (level 9, as Wikipedia)
  enwiki-xN-multistream.xml.bz2     the same as Wikipedia's multistream layout: the header in
                                    its own stream, then one stream per 100 pages
Usage: make_wiki_inputs.py CHUNK.bz2 OUT_DIR N
"""
import bz2
import os
import sys


def main():
    chunk, out_dir, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    os.makedirs(out_dir, exist_ok=True)
    with bz2.open(chunk, "rb") as f:
        xml = f.read()
    first = xml.index(b"<page>")
    last = xml.rindex(b"</page>") + len(b"</page>")
    head, pages, tail = xml[:first], xml[first:last], xml[last:]
    big = head + pages * n + tail
    with open(os.path.join(out_dir, "enwiki.xml"), "wb") as f:
        f.write(xml)
    with open(os.path.join(out_dir, f"enwiki-x{n}.xml"), "wb") as f:
        f.write(big)
    with open(os.path.join(out_dir, f"enwiki-x{n}.xml.bz2"), "wb") as f:
        f.write(bz2.compress(big, 9))
    starts = []
    pos = big.find(b"<page>")
    while pos != -1:
        starts.append(pos)
        pos = big.find(b"<page>", pos + 1)
    cuts = [0, starts[0]] + starts[100::100] + [len(big)]
    with open(os.path.join(out_dir, f"enwiki-x{n}-multistream.xml.bz2"), "wb") as f:
        for a, b in zip(cuts, cuts[1:]):
            f.write(bz2.compress(big[a:b], 9))
    print(f"{len(big)} bytes of XML, {len(starts)} pages, {len(cuts) - 1} multistream streams")


if __name__ == "__main__":
    main()
