# bertkit: the two commands a new user needs are `make demo` and `make test`.
#
#   make demo [MIRROR=../shared/data]   build, then run the pipeline on small real data
#   make test                           every test (what CI runs)
#   make lint                           rustfmt check and clippy
#   make bench-format                   format-stage benchmark vs WikiExtractor and bzip2 -dc
#   make bench-shard                    shard-stage throughput and peak memory at 1x, 4x, 16x
#   make bench-records GOOGLE_BERT=DIR  records stage vs Google's create_pretraining_data.py
#                                       (DIR: a google-research/bert checkout)

# Where the demo data comes from: a folder laid out like ../shared/data.
MIRROR ?= $(or $(BERTKIT_SHARED_DATA),../shared/data)
# Where outputs go.
OUT ?= out
CARGO ?= cargo
BERTKIT := target/release/bertkit
ENWIKI_CHUNK := wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2

.PHONY: all build demo test lint bench-format bench-shard bench-records clean

all: build

build:
	$(CARGO) build --release --locked

demo: build
	@echo "== download: the demo source set (pipelines/sources.toml) from MIRROR=$(MIRROR)"
	$(BERTKIT) download sources --set demo --mirror "$(MIRROR)" --output $(OUT)/demo/raw
	@echo
	@echo "== format: Wikipedia dump chunk"
	$(BERTKIT) format wiki --input "$(OUT)/demo/raw/$(ENWIKI_CHUNK)" --output $(OUT)/demo/formatted/wiki
	@echo
	@echo "== format: Project Gutenberg books"
	$(BERTKIT) format books --input $(OUT)/demo/raw/gutenberg --output $(OUT)/demo/formatted/books
	@echo
	@echo "== shard: both sources into shuffled, balanced train/test shards"
	$(BERTKIT) shard --input $(OUT)/demo/formatted/wiki $(OUT)/demo/formatted/books --output $(OUT)/demo/shards \
		--num-train-shards 4 --num-test-shards 1 --test-fraction 0.1 --seed 12345
	@echo
	@echo "== records: phase-1 masked-LM / next-sentence instances, one Parquet file per train shard"
	$(BERTKIT) records --input $(OUT)/demo/shards/train --vocab $(OUT)/demo/raw/minilm/vocab.txt \
		--output $(OUT)/demo/records/phase1 --phase 1 --dupe-factor 1 --seed 12345
	@echo
	@echo "demo output: $(OUT)/demo/raw/ (downloads), $(OUT)/demo/formatted/ (wiki/, books/), $(OUT)/demo/shards/ (train/, test/), $(OUT)/demo/records/phase1/ (Parquet)"

test:
	$(CARGO) test --workspace --locked

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

bench/.venv/bin/python:
	python3 -m venv bench/.venv
	bench/.venv/bin/pip install --quiet wikiextractor==3.1.0

bench-format: build bench/.venv/bin/python
	python3 bench/format_wiki.py --bertkit $(BERTKIT) --chunk "$(MIRROR)/$(ENWIKI_CHUNK)"

bench-shard: build
	@test -x /usr/bin/time || { apt-get update -qq && apt-get install -y -qq time; }
	python3 bench/shard_scaling.py --bertkit $(BERTKIT) --shared "$(MIRROR)"

bench-records: build
	@test -n "$(GOOGLE_BERT)" || { echo "error: set GOOGLE_BERT to a google-research/bert checkout (the peer)" >&2; exit 1; }
	python3 bench/records_throughput.py --bertkit $(BERTKIT) --shared "$(MIRROR)" --google-bert "$(GOOGLE_BERT)"

clean:
	$(CARGO) clean
	rm -rf $(OUT) bench/.venv
