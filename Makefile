# bertkit: the two commands a new user needs are `make demo` and `make test`.
#
#   make demo [MIRROR=../shared/data]   build, then run the pipeline on small real data
#   make data                           the full pipeline (pipelines/data.toml)
#   make pretrain-phase1 / -phase2      NVIDIA's BERT-large recipe on the data (resumes if stopped)
#   make finetune-glue TASK=mrpc [MODEL=dir]  fine-tune (default: the shared MiniLM) and score dev
#   make finetune-squad [MODEL=dir] [SQUAD_TRAIN=train.json SQUAD_DEV=dev.json] [SQUAD_FLAGS=…]
#                                       fine-tune, predict and score SQuAD (offline: the split of
#                                       the mirror's dev-v1.1.json, first 38 articles / last 10)
#   make test                           every test (what CI runs); installs pyarrow when missing
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
# Where cargo puts its builds: CARGO_TARGET_DIR, a `build.target-dir` in a cargo config, or target/.
TARGET_DIR ?= $(or $(shell $(CARGO) metadata --no-deps --format-version 1 2>/dev/null \
	| python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])' 2>/dev/null),$(CARGO_TARGET_DIR),target)
BERTKIT := $(TARGET_DIR)/release/bertkit
# What the tests need beyond Rust: a Python with pyarrow >= 16 (a test reads the records stage's
# Parquet files with it, as users will; the files use BYTE_STREAM_SPLIT for integers). The
# system's python3 when it has it, else a virtual environment made here on first use.
TEST_VENV := .venv/test
PYARROW_OK := import sys, pyarrow; sys.exit(int(pyarrow.__version__.split('.')[0]) < 16)
ENWIKI_CHUNK := wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2

PHONY_TRAIN := pretrain-phase1 pretrain-phase2 finetune-glue finetune-squad
.PHONY: all build demo data test lint $(PHONY_TRAIN) bench-format bench-shard bench-records clean

all: build

build:
	$(CARGO) build --release --locked

demo: build
	@echo "== the demo pipeline (pipelines/demo.toml), downloading from MIRROR=$(MIRROR)"
	$(BERTKIT) pipeline --config pipelines/demo.toml --mirror "$(MIRROR)"
	@echo "== a tiny BERT pre-trained on the demo records (pipelines/tiny.toml), on the CPU"
	$(BERTKIT) pretrain --config pipelines/tiny.toml $(if $(wildcard out/demo/tiny-run/checkpoints/step-*),--resume)
	$(BERTKIT) plot out/demo/tiny-run/metrics.jsonl -o out/demo/tiny-run/loss.svg

# Fine-tune a model folder on a GLUE task (MRPC, CoLA, SST-2, MNLI) from the shared data layout.
TASK ?= mrpc
MODEL ?= $(MIRROR)/minilm
finetune-glue: build
	$(BERTKIT) finetune glue --task $(TASK) --model "$(MODEL)" --data "$(MIRROR)/glue/$(shell echo $(TASK) | sed 's/mrpc/MRPC/;s/cola/CoLA/;s/sst-2/SST-2/;s/sst2/SST-2/;s/mnli/MNLI/')" -o out/finetune/$(TASK)

# Fine-tune on SQuAD, then predict and score the dev set (files in out/finetune/squad/predictions/).
# Without SQUAD_TRAIN: the documented offline split of SQuAD v1.1 dev (train on its first 38
# articles, 8,582 questions; evaluate on the last 10, 1,988 questions). On a CPU, a short run:
# SQUAD_FLAGS="--epochs 0.45 --batch 32 --accumulation 4" (see BENCHMARKS.md).
SQUAD_TRAIN ?=
SQUAD_DEV ?=
SQUAD_FLAGS ?=
finetune-squad: build
ifeq ($(SQUAD_TRAIN),)
	$(BERTKIT) split squad --input "$(MIRROR)/squad/dev-v1.1.json" --train-articles 38 -o $(OUT)/squad-split
	$(BERTKIT) finetune squad --model "$(MODEL)" --train $(OUT)/squad-split/train.json --dev $(OUT)/squad-split/dev.json -o $(OUT)/finetune/squad $(SQUAD_FLAGS)
else
	$(BERTKIT) finetune squad --model "$(MODEL)" --train "$(SQUAD_TRAIN)" $(if $(SQUAD_DEV),--dev "$(SQUAD_DEV)") -o $(OUT)/finetune/squad $(SQUAD_FLAGS)
endif

pretrain-phase1: build
	$(BERTKIT) pretrain --config pipelines/pretrain-phase1.toml $(if $(wildcard runs/phase1/checkpoints/step-*),--resume)

pretrain-phase2: build
	$(BERTKIT) pretrain --config pipelines/pretrain-phase2.toml $(if $(wildcard runs/phase2/checkpoints/step-*),--resume)

data: build
	@echo "== the full data pipeline (pipelines/data.toml): downloads tens of GB"
	$(BERTKIT) pipeline --config pipelines/data.toml

test:
	@py=python3; \
	if ! $$py -c "$(PYARROW_OK)" >/dev/null 2>&1; then \
		py="$(CURDIR)/$(TEST_VENV)/bin/python"; \
		if ! "$$py" -c "$(PYARROW_OK)" >/dev/null 2>&1; then \
			echo "== installing what the tests need: pyarrow>=16 into $(TEST_VENV)"; \
			python3 -m venv "$(TEST_VENV)" && \
			"$$py" -m pip install --quiet --disable-pip-version-check "pyarrow>=16" || exit 1; \
		fi; \
	fi; \
	echo "== cargo test (pyarrow from $$py)"; \
	BERTKIT_PYTHON="$$py" $(CARGO) test --workspace --locked

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

# The benchmarks' Python: WikiExtractor (the format peer), six (Google's tokenization.py imports
# it) and pyarrow (the records bench checks the Parquet it times).
BENCH_PYTHON := bench/.venv/bin/python
BENCH_DEPS := bench/.venv/.installed-wikiextractor-six-pyarrow
$(BENCH_DEPS):
	python3 -m venv bench/.venv
	$(BENCH_PYTHON) -m pip install --quiet --disable-pip-version-check wikiextractor==3.1.0 six "pyarrow>=16"
	touch $@

bench-format: build $(BENCH_DEPS)
	$(BENCH_PYTHON) bench/format_wiki.py --bertkit $(BERTKIT) --chunk "$(MIRROR)/$(ENWIKI_CHUNK)"

bench-shard: build
	@test -x /usr/bin/time || { apt-get update -qq && apt-get install -y -qq time; }
	python3 bench/shard_scaling.py --bertkit $(BERTKIT) --shared "$(MIRROR)"

bench-records: build $(BENCH_DEPS)
	@test -n "$(GOOGLE_BERT)" || { echo "error: set GOOGLE_BERT to a google-research/bert checkout (the peer)" >&2; exit 1; }
	$(BENCH_PYTHON) bench/records_throughput.py --bertkit $(BERTKIT) --shared "$(MIRROR)" --google-bert "$(GOOGLE_BERT)"

clean:
	$(CARGO) clean
	rm -rf $(OUT) bench/.venv $(TEST_VENV)
