# bertkit: the two commands a new user needs are `make demo` and `make test`.
#
#   make demo [MIRROR=../shared/data]   build, then run the pipeline on small real data
#   make data                           the full pipeline (pipelines/data.toml)
#   make pretrain-phase1 / -phase2      NVIDIA's BERT-large recipe on the data (resumes if stopped)
#                                       into RUNS=runs/phase1, /phase2; on a GPU (CUDA build made
#                                       here), or DEVICE=cpu MAX_STEPS=2 [PRESET=tiny]
#                                       [RECORDS=out/demo/records]
#   make finetune-glue TASK=mrpc [MODEL=dir]  fine-tune (default: phase 2's run where there is
#                                       one, else the shared MiniLM) and score dev
#   make finetune-squad [MODEL=dir] [SQUAD_TRAIN=train.json SQUAD_DEV=dev.json] [SQUAD_FLAGS=…]
#   (the three chain: make pretrain-phase1 pretrain-phase2 finetune-squad fine-tunes the model
#   phase 2 wrote; BERTKIT=path runs an installed binary instead of building one)
#                                       fine-tune, predict and score SQuAD (offline: the split of
#                                       the mirror's dev-v1.1.json, first 38 articles / last 10)
#   make test                           every test (what CI runs); installs pyarrow and
#                                       tensorboard, and OpenMPI for the data-parallel tests,
#                                       when missing; with g++, also the CUDA kernels that the
#                                       CPU emulation runs (make cuda-emulated)
#   make lint                           rustfmt check and clippy
#   make docs                           write every command's flags into docs/configuration.md
#                                       (a test fails where they differ)
#   make fuzz [FUZZ_SECONDS=60] [FUZZ_TARGETS=a,b] [FUZZ_EXECUTIONS=N]  libFuzzer on every
#                                       parser of user input; FUZZ_EXECUTIONS stops a target once
#                                       its runs add up to N (installs cargo-fuzz when missing;
#                                       FUZZING.md)
#   make bench-format                   format-stage benchmark vs WikiExtractor and bzip2 -dc
#   make bench-shard                    shard-stage throughput and peak memory at 1x, 4x, 16x
#   make bench-records GOOGLE_BERT=DIR  records stage vs Google's create_pretraining_data.py
#                                       (DIR: a google-research/bert checkout)
#   make bench-gpu [BENCH_GPU_PYTHON=python3]  bertkit beside PyTorch + transformers on this
#                                       machine's GPU: phase 1 and 2 steps, inference, SQuAD
#                                       and MRPC steps, the forward check; one table of ratios
#                                       (bench/gpu/pack.sh packs it for a machine reached
#                                       through one call)
#   make bench-scale [GB=1,4,10] [GOOGLE_BERT=DIR]  make data's chain on a generated, diverse
#                                       Wikipedia-like corpus of GB gigabytes of XML, 1 and 2
#                                       threads, beside the repeated-chunk baseline (needs ~40 GB
#                                       of disk at 10 GB; see BENCHMARKS.md)

# Where the demo data comes from: a folder laid out like ../shared/data.
MIRROR ?= $(or $(BERTKIT_SHARED_DATA),../shared/data)
# Where outputs go.
OUT ?= out
CARGO ?= cargo
# Where cargo puts its builds: CARGO_TARGET_DIR, a `build.target-dir` in a cargo config, or target/.
TARGET_DIR ?= $(or $(shell $(CARGO) metadata --no-deps --format-version 1 2>/dev/null \
	| python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])' 2>/dev/null),$(CARGO_TARGET_DIR),target)
# BERTKIT=path runs that binary (an installed one: `cargo install --path crates/cli`) and builds
# nothing; by default the targets build the workspace's own.
BERTKIT ?=
OWN_BUILD := $(if $(BERTKIT),,yes)
override BERTKIT := $(or $(BERTKIT),$(TARGET_DIR)/release/bertkit)
BUILD := $(if $(OWN_BUILD),build)
# What the tests need beyond Rust: a Python with pyarrow >= 16 (a test reads the records stage's
# Parquet files with it, as users will; the files use BYTE_STREAM_SPLIT for integers) and
# tensorboard (a test reads the trainer's event files with TensorBoard's own reader). The
# system's python3 when it has them, else a virtual environment made here on first use.
TEST_VENV := .venv/test
TEST_PYTHON_PACKAGES := "pyarrow>=16" tensorboard
PYTHON_OK := import sys, pyarrow, tensorboard; sys.exit(int(pyarrow.__version__.split('.')[0]) < 16)
ENWIKI_CHUNK := wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2

PHONY_TRAIN := pretrain-phase1 pretrain-phase2 finetune-glue finetune-squad
.PHONY: all build build-train require-gpu demo data test cuda-emulated lint docs fuzz mpi-deps $(PHONY_TRAIN) bench-format bench-shard bench-records bench-scale bench-gpu clean

all: build

build:
	$(CARGO) build --release --locked

# The flags section of docs/configuration.md, from the binary's own command tree.
docs:
	$(CARGO) run --quiet --locked -p bertkit -- reference > target/flags.md
	python3 -c 'import sys; p = "docs/configuration.md"; b = "<!-- generated by `bertkit reference` (make docs); do not edit by hand -->\n"; e = "<!-- end of generated flags -->"; t = open(p).read(); head, rest = t.split(b, 1); tail = rest.split(e, 1)[1]; open(p, "w").write(head + b + open("target/flags.md").read() + e + tail)'

demo: $(BUILD)
	@echo "== the demo pipeline (pipelines/demo.toml), downloading from MIRROR=$(MIRROR)"
	$(BERTKIT) pipeline --config pipelines/demo.toml --mirror "$(MIRROR)"
	@echo "== a tiny BERT pre-trained on the demo records (pipelines/tiny.toml), on the CPU"
	$(BERTKIT) pretrain --config pipelines/tiny.toml $(if $(wildcard out/demo/tiny-run/checkpoints/step-*),--resume)
	$(BERTKIT) plot out/demo/tiny-run/metrics.jsonl -o out/demo/tiny-run/loss.svg

# Training and fine-tuning run on a GPU where one is present: the binary is then built with
# CUDA (into $(TARGET_DIR)/cuda, beside the CPU build). DEVICE=cpu runs the same recipe on the
# CPU (with MAX_STEPS=N, a smoke test); FEATURES=cuda builds the CUDA binary anyway.
HAVE_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo yes)
DEVICE ?= $(if $(HAVE_GPU),cuda,cpu)
FEATURES ?= $(if $(filter cuda%,$(DEVICE)),cuda)
MAX_STEPS ?=
TRAIN_BERTKIT := $(if $(OWN_BUILD),$(if $(FEATURES),$(TARGET_DIR)/cuda/release/bertkit,$(BERTKIT)),$(BERTKIT))
BUILD_TRAIN := $(if $(OWN_BUILD),build-train)
TRAIN_FLAGS := --device $(DEVICE) $(if $(MAX_STEPS),--max-steps $(MAX_STEPS))
# Fine-tuning goes on from its newest checkpoint when run again (none: from the start).
FINETUNE_FLAGS := $(TRAIN_FLAGS) --resume
# Where the pre-training runs go: $(RUNS)/phase1, $(RUNS)/phase2 (phase 2 starts from phase 1's
# model). Each run folder ends as a model folder (config.json, model.safetensors, vocab.txt,
# tokenizer_config.json) that the fine-tuning targets take.
RUNS ?= runs
# Pre-training overrides. RECORDS=folder: its phase1/ and phase2/ records (and phase1-heldout/,
# phase2-heldout/ for the held-out evaluation, where present) instead of the recipes' data/records
# (make demo makes out/demo/records). PRESET=tiny|base|large: another model than the recipes'
# BERT-large (a smoke run). On the CPU the recipe's batch (65536 sequences a step, 256 or 32 at a
# time) would take hours a step and more memory than a CPU machine has, so DEVICE=cpu runs 4
# sequences a step, 2 at a time, unless MICRO_BATCH/GLOBAL_BATCH say.
RECORDS ?=
PRESET ?=
MICRO_BATCH ?= $(if $(filter cpu,$(DEVICE)),2)
GLOBAL_BATCH ?= $(if $(filter cpu,$(DEVICE)),4)
# Expanded in the recipe, where $* is the phase and the earlier phase's run is on disk.
PRETRAIN_FLAGS = --output $(RUNS)/$* $(if $(filter phase2,$*),--set model.init=$(RUNS)/phase1) \
	$(if $(PRESET),--set model.preset=$(PRESET)) \
	$(if $(RECORDS),--data $(RECORDS)/$* $(if $(wildcard $(RECORDS)/$*-heldout),--eval-data $(RECORDS)/$*-heldout,--no-eval)) \
	$(if $(MICRO_BATCH),--micro-batch $(MICRO_BATCH)) $(if $(GLOBAL_BATCH),--global-batch $(GLOBAL_BATCH)) \
	$(if $(wildcard $(RUNS)/$*/checkpoints/step-*),--resume)
# The pre-training recipes are BERT-large on GPUs: without one, say what is missing rather than
# start a months-long CPU run.
define NO_GPU
no NVIDIA GPU found (nvidia-smi -L lists none). The recipe needs one with its driver (for the
CUDA 13.0 build: driver >= 580) and the CUDA 13.0 toolkit (nvcc) to build with. To try the
same recipe on this machine's CPU: make $(MAKECMDGOALS) DEVICE=cpu MAX_STEPS=2 (PRESET=tiny for a
small model; RECORDS=out/demo/records after make demo, if make data has not run)
endef
define NO_NVCC
the CUDA build needs nvcc 13.0 (the CUDA toolkit: NVIDIA's cuda-toolkit-13-0 package, with
cuBLAS and cuRAND) on PATH, or CUDA_ROOT set to it. Or run on the CPU: make $(MAKECMDGOALS) DEVICE=cpu
endef
export NO_GPU NO_NVCC

# The compute capability the CUDA kernels are built for: the GPUs' own, as nvidia-smi reports
# it (90 on H100/H200, 80 on A100), so the PTX is written for the card's architecture (the
# driver compiles PTX for the GPU at a machine's first run either way, and caches it). candle
# builds its kernels for one capability; with several kinds of GPU the lowest is taken (its
# code runs on the newer ones). Without a GPU here, 80 (runs on A100 and on H100/H200);
# CUDA_COMPUTE_CAP=90 builds for a Hopper elsewhere.
GPU_COMPUTE_CAP := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null \
	| tr -d ' .' | grep -E '^[0-9]+$$' | sort -n | head -n 1)
CUDA_COMPUTE_CAP ?= $(or $(GPU_COMPUTE_CAP),80)
COMPUTE_CAP_SOURCE := $(if $(filter command line environment,$(origin CUDA_COMPUTE_CAP)),CUDA_COMPUTE_CAP,$(if $(GPU_COMPUTE_CAP),nvidia-smi,no GPU found: the default))

build-train:
ifeq ($(OWN_BUILD),)
	@echo "== BERTKIT=$(BERTKIT): nothing to build"
else ifneq ($(FEATURES),)
	@command -v nvcc >/dev/null 2>&1 || [ -x "$$CUDA_ROOT/bin/nvcc" ] || { echo "$$NO_NVCC" >&2; exit 1; }
	@echo "== CUDA build for compute capability $(CUDA_COMPUTE_CAP) ($(COMPUTE_CAP_SOURCE)) into $(TARGET_DIR)/cuda"
	CUDA_COMPUTE_CAP=$(CUDA_COMPUTE_CAP) $(CARGO) build --release --locked --features $(FEATURES) --target-dir $(TARGET_DIR)/cuda
else
	$(CARGO) build --release --locked
endif

# The model the fine-tuning targets start from: phase 2's run where it has written one (so
# `make pretrain-phase1 pretrain-phase2 finetune-squad` fine-tunes the model it pre-trained),
# else the shared MiniLM. Expanded in the recipe, after phase 2 has run.
MODEL ?= $(if $(wildcard $(RUNS)/phase2/model.safetensors $(RUNS)/phase2/checkpoints/step-*),$(RUNS)/phase2,$(MIRROR)/minilm)
# Within one make, each stage waits for the one before it (also under -j).
pretrain-phase2: $(filter pretrain-phase1,$(MAKECMDGOALS))
finetune-glue finetune-squad: $(filter pretrain-phase2,$(MAKECMDGOALS))

# Fine-tune a model folder on a GLUE task (MRPC, CoLA, SST-2, MNLI) from the shared data layout.
TASK ?= mrpc
finetune-glue: $(BUILD_TRAIN)
	@echo "== fine-tuning $(MODEL) on $(TASK)"
	$(TRAIN_BERTKIT) finetune glue --task $(TASK) --model "$(MODEL)" --data "$(MIRROR)/glue/$(shell echo $(TASK) | sed 's/mrpc/MRPC/;s/cola/CoLA/;s/sst-2/SST-2/;s/sst2/SST-2/;s/mnli/MNLI/')" -o $(OUT)/finetune/$(TASK) $(FINETUNE_FLAGS)

# Fine-tune on SQuAD, then predict and score the dev set (files in out/finetune/squad/predictions/).
# Without SQUAD_TRAIN: the documented offline split of SQuAD v1.1 dev (train on its first 38
# articles, 8,582 questions; evaluate on the last 10, 1,988 questions). On a CPU, a short run:
# SQUAD_FLAGS="--epochs 0.45 --batch 32 --accumulation 4" (see BENCHMARKS.md).
SQUAD_TRAIN ?=
SQUAD_DEV ?=
SQUAD_FLAGS ?=
finetune-squad: $(BUILD_TRAIN)
	@echo "== fine-tuning $(MODEL) on SQuAD"
ifeq ($(SQUAD_TRAIN),)
	$(TRAIN_BERTKIT) split squad --input "$(MIRROR)/squad/dev-v1.1.json" --train-articles 38 -o $(OUT)/squad-split
	$(TRAIN_BERTKIT) finetune squad --model "$(MODEL)" --train $(OUT)/squad-split/train.json --dev $(OUT)/squad-split/dev.json -o $(OUT)/finetune/squad $(FINETUNE_FLAGS) $(SQUAD_FLAGS)
else
	$(TRAIN_BERTKIT) finetune squad --model "$(MODEL)" --train "$(SQUAD_TRAIN)" $(if $(SQUAD_DEV),--dev "$(SQUAD_DEV)") -o $(OUT)/finetune/squad $(FINETUNE_FLAGS) $(SQUAD_FLAGS)
endif

require-gpu:
	@[ -n "$(HAVE_GPU)" ] || [ "$(origin DEVICE)" != file ] || { echo "$$NO_GPU" >&2; exit 1; }

pretrain-phase1 pretrain-phase2: pretrain-%: require-gpu $(BUILD_TRAIN)
	$(TRAIN_BERTKIT) pretrain --config pipelines/pretrain-$*.toml $(TRAIN_FLAGS) $(PRETRAIN_FLAGS)

# The Wikipedia dump: pipelines/data.toml's pinned date unless WIKI_DATE names another (see
# that file for how to pick one).
WIKI_DATE ?=
data: $(BUILD)
	@echo "== the full data pipeline (pipelines/data.toml): downloads ~22 GB, writes ~370 GB (docs/data-pipeline.md)"
	$(BERTKIT) pipeline --config pipelines/data.toml $(if $(WIKI_DATE),--var date=$(WIKI_DATE))

# The data-parallel tests run ranks under mpirun: OpenMPI, and libclang for the `mpi` crate's
# bindings, from the distribution's packages when missing (Debian/Ubuntu names).
MPI_PACKAGES := openmpi-bin libopenmpi-dev libclang-dev
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
mpi-deps:
	@if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1 \
		|| ! { dpkg -s libclang-dev >/dev/null 2>&1 || command -v llvm-config >/dev/null 2>&1; }; then \
		echo "== installing what the data-parallel tests need: $(MPI_PACKAGES)"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(MPI_PACKAGES) >/dev/null || exit 1; \
	fi

test: mpi-deps
	@py=python3; \
	if ! $$py -c "$(PYTHON_OK)" >/dev/null 2>&1; then \
		py="$(CURDIR)/$(TEST_VENV)/bin/python"; \
		if ! "$$py" -c "$(PYTHON_OK)" >/dev/null 2>&1; then \
			echo '== installing what the tests need: $(TEST_PYTHON_PACKAGES) into $(TEST_VENV)'; \
			python3 -m venv "$(TEST_VENV)" && \
			"$$py" -m pip install --quiet --disable-pip-version-check $(TEST_PYTHON_PACKAGES) || exit 1; \
		fi; \
	fi; \
	echo "== cargo test (pyarrow and tensorboard from $$py)"; \
	BERTKIT_PYTHON="$$py" $(CARGO) test --workspace --locked --features bertkit/mpi
	@$(MAKE) --no-print-directory cuda-emulated

# The CUDA kernels written in plain CUDA C, compiled for the CPU emulation (bench/gpu/emulate:
# the one-pass attention, the embedding lookup, the loss, the gradient sums, the bias backward,
# the optimiser's update) and run against their references, without a GPU: each new kernel
# before its device run, all of them after every change. Needs g++ (C++20); where there is none
# it says so and checks nothing.
cuda-emulated:
	@if command -v g++ >/dev/null 2>&1; then \
		echo "== the CUDA kernels on the CPU emulation (bench/gpu/emulate)"; \
		bash bench/gpu/emulate/run.sh; \
	else \
		echo "== not checked: the CUDA kernels' CPU emulation needs g++"; \
	fi

lint: mpi-deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings
	$(CARGO) clippy --workspace --all-targets --locked --features bertkit/mpi -- -D warnings

# Fuzzing (FUZZING.md): each target FUZZ_SECONDS, a process per core (a target in several when
# there are fewer targets than cores); corpora kept under fuzz/corpus between runs. cargo fuzz
# runs on stable Rust with --sanitizer none.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?=
FUZZ_EXECUTIONS ?=
fuzz:
	@command -v cargo-fuzz >/dev/null 2>&1 || { echo "== installing cargo-fuzz"; $(CARGO) install cargo-fuzz --locked; }
	python3 fuzz/run.py --seconds $(FUZZ_SECONDS) $(if $(FUZZ_TARGETS),--targets $(FUZZ_TARGETS)) $(if $(FUZZ_EXECUTIONS),--executions $(FUZZ_EXECUTIONS))

# The benchmarks' Python: WikiExtractor (the format peer), six (Google's tokenization.py imports
# it), pyarrow (the records benches check the Parquet they time) and numpy (the scale bench's
# corpus generator).
BENCH_PYTHON := bench/.venv/bin/python
BENCH_DEPS := bench/.venv/.installed-wikiextractor-six-pyarrow-numpy
$(BENCH_DEPS):
	python3 -m venv bench/.venv
	$(BENCH_PYTHON) -m pip install --quiet --disable-pip-version-check wikiextractor==3.1.0 six "pyarrow>=16" numpy
	touch $@

# bertkit beside PyTorch + transformers on this machine's GPU (DEVICE=cpu: the same plumbing on
# the CPU, with MODEL=config.json for a small model): the CUDA build, the data
# (bench/gpu/prepare.sh) and bench/gpu/side_by_side.sh. BENCH_GPU_PYTHON needs torch and
# transformers.
BENCH_GPU_PYTHON ?= python3
bench-gpu: build-train
	bash bench/gpu/prepare.sh $(TRAIN_BERTKIT) "$(MIRROR)" $(OUT)/bench-gpu/data
	OUT=$(OUT)/bench-gpu DEVICE=$(DEVICE) bash bench/gpu/side_by_side.sh --bertkit $(TRAIN_BERTKIT) \
	    --python $(BENCH_GPU_PYTHON) --data $(OUT)/bench-gpu/data

bench-format: build $(BENCH_DEPS)
	$(BENCH_PYTHON) bench/format_wiki.py --bertkit $(BERTKIT) --chunk "$(MIRROR)/$(ENWIKI_CHUNK)"

bench-shard: build
	@test -x /usr/bin/time || { apt-get update -qq && apt-get install -y -qq time; }
	python3 bench/shard_scaling.py --bertkit $(BERTKIT) --shared "$(MIRROR)"

bench-records: build $(BENCH_DEPS)
	@test -n "$(GOOGLE_BERT)" || { echo "error: set GOOGLE_BERT to a google-research/bert checkout (the peer)" >&2; exit 1; }
	$(BENCH_PYTHON) bench/records_throughput.py --bertkit $(BERTKIT) --shared "$(MIRROR)" --google-bert "$(GOOGLE_BERT)"

# The scale bench: corpora and runs under $(OUT)/bench-scale (the largest corpus is kept, so a
# re-run measures without generating it again).
GB ?= 1,4,10
bench-scale: build $(BENCH_DEPS)
	$(BENCH_PYTHON) bench/scale.py --bertkit $(BERTKIT) --shared "$(MIRROR)" --work $(OUT)/bench-scale \
		--gb $(GB) $(if $(GOOGLE_BERT),--google-bert "$(GOOGLE_BERT)")

clean:
	$(CARGO) clean
	rm -rf $(OUT) bench/.venv $(TEST_VENV)
