# sluice: build, demo and test entry points. Every target first makes sure the build's Debian
# packages are installed and the patched llama.cpp is unpacked (vendor/sync).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
CARGO ?= cargo

# systemd: systemd-analyze, which the service-file tests run on systemd/sluice.service.
# util-linux: prlimit, which gives a test server a small open-file limit. python3-venv: the
# official openai client for the API test (scripts/ensure-openai). wamerican: the dictionary the
# demo's words are checked against. valgrind: the extension tests run again under memcheck.
BUILD_DEBS := cmake clang libclang-dev patch make systemd util-linux python3-venv wamerican valgrind
# Where apt reaches them: chromium, the headless browser that loads the status page; lintian,
# which checks the Debian package. Without them those checks are skipped with a message.
CHECK_DEBS := chromium chromium-driver lintian tmux
ARM_DEBS := gcc-aarch64-linux-gnu g++-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
AARCH64 := aarch64-unknown-linux-gnu

# cargo-deb, which builds the Debian packages (scripts/ensure-cargo-deb installs it).
CARGO_DEB_VERSION := 3.8.0
DEB_DIR := target/deb

# The official openai Python client, for the API test (target/openai-venv).
OPENAI_VENV := $(CURDIR)/target/openai-venv
OPENAI_ENV := SLUICE_OPENAI_PYTHON=$(OPENAI_VENV)/bin/python

# Cross-building for aarch64 with Debian's toolchain; the tests run under qemu-aarch64.
ARM_ENV := CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
	CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc \
	CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++ \
	CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER=qemu-aarch64 \
	QEMU_LD_PREFIX=/usr/aarch64-linux-gnu \
	SLUICE_TEST_RUNNER=qemu-aarch64 \
	SLUICE_GATE_FIXTURES=f32,q8_0,deepseek2,gptoss

# The tests of the gates (the sluice-tests crate) run one at a time: each computes with two
# threads, and two at once on two cores leave ggml's threads waiting on each other. Under
# qemu-aarch64 a sample runs: every unit test, the gates where aarch64's kernels and syscalls
# differ (streamed == resident, runs together, lossy, cold loads, boards, pinning, the extension
# layer, the compute threads' waits, mapped faults), RPC between two aarch64 processes and the
# checksums; the command line and the HTTP-level suites (the CLI, the server, agents, fuzzing,
# hostile requests and RPC peers, templates, the status page, conversations) test code that is the
# same on every architecture and run natively, and so do saved slots (llama.cpp's state format and
# the same decode the streamed == resident gate checks under qemu: nearly ten minutes of CI for no
# code of aarch64's own) and synth's skewed routing (a bench model's calibration, not the board's
# runtime: under three minutes of qemu). Only what the sample runs is built.
QEMU_SAMPLE := --test ext --test thread_waits --test mapping_faults --test scaleout --test verify
QEMU_GATES := --test foundation --test streaming --test batched --test lossy \
	--test cold_load --test boards --test pinning

# The KJV MoE models trained here (trainer/): the trainer's Python packages live in TRAINER_VENV;
# each model is trained once per machine into sluice's cache directory.
TRAINER_VENV := $(CURDIR)/target/trainer-venv

.PHONY: help deps vendor build demo test aarch64 deb lint bench bench-board bench-board-120b bench-board-trained bench-pull cuda-check clean trained-model trained-model-small trained-model-board trained-model-board-small

# make bench: two synthetic gpt-oss models about 3x a small board's memory, one with a random
# router (uniform) and one with skewed expert popularity and token-to-token reuse (synth's
# defaults; the models and their checksum sidecars are kept in BENCH_DIR: delete them after
# changing synth), streamed vs llama.cpp's mmap load, each configuration in a memory cgroup of
# BENCH_BUDGET_MB (needs root), on the release build, with a 512-token prompt (32 generated
# tokens, 16 at SD speed) and a row per lossy mode: at the disk's own speed, then throttled to an
# SD card's (85 MB/s) and a Pi 5 NVMe HAT's (400 MB/s) (a cgroup throttle for the mmap load and
# the ceiling, and the lanes paced to the same rate, which a throttle's burst after idle time
# cannot beat), with a read sweep (lanes x request size)
# on the uniform model, rows with the model split over two and three boards of the same budget
# (loopback RPC workers), rows checking every read against the model's checksum sidecar
# (--verify), and on the skewed model at SD and NVMe speed the conversation rows (a five-turn
# chat with and without prompt reuse, a restart that reads the saved slot back, 1, 2 and 4
# clients at once; --conversations), and each run's serial automatic-cache routes replayed under
# each cache policy and Belady's MIN (--trace: replay.csv). Results under
# BENCH_DIR/<routing>-<speed>/.
BENCH_DIR ?= target/bench
BENCH_BUDGET_MB ?= 512
# The trained KJV model's rows (its own router making the routes): a cgroup small enough that
# the automatic expert cache holds at most a quarter of its experts, a prompt from its held-out
# chapters, their perplexity (at the disk's speed); then each lossy knob's perplexity cost. No
# lossy rows: their quality run, in the same child after the row, does not fit this cgroup.
TRAINED_BUDGET_MB ?= 66

help:
	@echo "make demo     run the trained KJV MoE model (the full one if trained, else the small one)"
	@echo "make trained-model        train the full KJV MoE model once (about 30 min); prints its path"
	@echo "make trained-model-small  the same recipe at CI's size (about 4 min)"
	@echo "make trained-model-board  a board-shaped one: 128 experts, 8 routed, 2 MiB experts (about 35 min)"
	@echo "make trained-model-board-small  the board shape at CI's size (about 5 min)"
	@echo "make test     build and run the whole test suite"
	@echo "make aarch64  cross-build for $(AARCH64) and run a sample of the tests under qemu-aarch64"
	@echo "make deb      Debian packages for amd64 and arm64 (release builds) in $(DEB_DIR)"
	@echo "make lint     rustfmt check and clippy with warnings as errors"
	@echo "make bench    streamed vs mmap on a model 3x a $(BENCH_BUDGET_MB) MiB memory cgroup (root)"
	@echo "make bench-board  Qwen3-30B-A3B's shape on its recorded routes in a Pi 5's and an Orin Nano's memory (root; ~18 GB of disk)"
	@echo "make bench-board-120b  gpt-oss-120b's shape on its recorded routes in the same boards' memory (root; ~63 GB of disk)"
	@echo "make bench-board-trained  the board-shaped model trained here on its own routes at 85-2000 MB/s (root; trains it once)"
	@echo "make bench-pull   sluice pull against curl on loopback, and the page cache of a served model beside each (root)"
	@echo "make cuda-check  compile ggml-sys with the CUDA backend against a toolkit from PyPI (no GPU needed; ~25 min)"

deps:
	@scripts/ensure-deps $(BUILD_DEBS)

vendor: deps
	@vendor/sync

build: vendor
	$(CARGO) build --workspace --bins

# The full trained model when it has been made, else the small one (trained on first use).
demo: build
	@model=$$(trainer/make-model --cached full) || { \
		echo "make demo: using the small trained model; make trained-model trains the full one (about 30 minutes)"; \
		model=$$(trainer/make-model small | tail -1); }; \
	$(CARGO) run --quiet --bin sluice -- demo --model "$$model"

trained-model: build
	@trainer/make-model full

trained-model-small: build
	@trainer/make-model small

trained-model-board: build
	@trainer/make-model board

trained-model-board-small: build
	@trainer/make-model board-small

# The tests that read the machine's load or wait on it run again beside two busy processes
# (scripts/test-under-load): make test must pass on a board that serves or beside a build.
# The package test checks an amd64 package made from the test build's binary (cargo-deb warns
# that it is not a release build: `make deb` makes those; the files, units and scripts are the
# same).
test: build
	@scripts/ensure-openai $(OPENAI_VENV)
	@scripts/ensure-deps $(CHECK_DEBS) || echo "make test: without $(CHECK_DEBS) the browser page and lintian checks are skipped"
	@scripts/ensure-cargo-deb $(CARGO_DEB_VERSION)
	$(CARGO) deb -p sluice --no-build --profile dev --strip --quiet -o $(DEB_DIR)/test/
	trained=$$(trainer/make-model small | tail -1); \
	board=$$(trainer/make-model board-small | tail -1); \
	export SLUICE_TRAINED_MODEL=$$trained SLUICE_TRAINED_BOARD_MODEL=$$board SLUICE_TRAINER_PYTHON=$(TRAINER_VENV)/bin/python; \
	status=0; \
	SLUICE_DEB=$$(ls $(CURDIR)/$(DEB_DIR)/test/sluice_*_amd64.deb) $(OPENAI_ENV) \
		$(CARGO) test --workspace --exclude sluice-tests --no-fail-fast || status=1; \
	$(CARGO) test -p sluice-tests --no-fail-fast -- --test-threads=1 || status=1; \
	CARGO=$(CARGO) scripts/test-under-load || status=1; \
	exit $$status

aarch64: vendor
	@scripts/ensure-deps --rust-target $(AARCH64) $(ARM_DEBS)
	$(ARM_ENV) $(CARGO) build --target $(AARCH64) --workspace --bins
	status=0; \
	$(ARM_ENV) $(CARGO) test --target $(AARCH64) --workspace --lib --bins $(QEMU_SAMPLE) --no-fail-fast || status=1; \
	$(ARM_ENV) $(CARGO) test --target $(AARCH64) -p sluice-tests $(QEMU_GATES) --no-fail-fast -- --test-threads=1 || status=1; \
	exit $$status

deb: vendor
	@scripts/ensure-cargo-deb $(CARGO_DEB_VERSION)
	$(CARGO) deb -p sluice --strip -o $(DEB_DIR)/
	@scripts/ensure-deps --rust-target $(AARCH64) $(ARM_DEBS)
	$(ARM_ENV) $(CARGO) deb -p sluice --strip --target $(AARCH64) -o $(DEB_DIR)/
	@ls -l $(DEB_DIR)/*.deb

bench: vendor
	$(CARGO) build --release --bin sluice
	@mkdir -p $(BENCH_DIR)
	@for r in uniform skewed; do \
		m=$(BENCH_DIR)/gptoss-$$r-f16-1650mb.gguf; \
		test -f $$m || target/release/sluice synth --out $$m --arch gpt-oss --routing $$r \
			--size 1650MB --layers 8 --experts 32 --experts-used 4 || exit 1; \
		test -f $$m.sluice-sums || target/release/sluice verify --model $$m || exit 1; \
	done
	@for r in uniform skewed; do for s in disk sd nvme-gen2; do \
		t=$$(case $$s in sd) echo "--storage-mbps sd --pace-mbps 85";; \
			nvme-gen2) echo "--storage-mbps nvme-gen2 --pace-mbps 400";; esac); \
		n=$$(test $$s = sd && echo 16 || echo 32); \
		w=$$(test $$r = uniform && echo --read-sweep || true); \
		c=$$(test $$r = skewed -a $$s != disk && echo --conversations || true); \
		echo "== $$r routing, $$s"; \
		target/release/sluice bench --model $(BENCH_DIR)/gptoss-$$r-f16-1650mb.gguf \
			--budget-mb $(BENCH_BUDGET_MB) -n $$n --prompt-tokens 512 $$t $$w \
			--experts-used 2 --substitute 4 --rpc --verify --trace $$c --out $(BENCH_DIR)/$$r-$$s || exit 1; \
	done; done
	@model=$$(SLUICE=target/release/sluice trainer/make-model full | tail -1); \
	held=$$(dirname $$model)/held-out.txt; \
	for s in disk sd nvme-gen2; do \
		t=$$(case $$s in sd) echo "--storage-mbps sd --pace-mbps 85";; \
			nvme-gen2) echo "--storage-mbps nvme-gen2 --pace-mbps 400";; esac); \
		p=$$(test $$s = disk && echo "--perplexity-file $$held --perplexity-chunks 60" || true); \
		echo "== the trained KJV model, $$s"; \
		target/release/sluice bench --model $$model --budget-mb $(TRAINED_BUDGET_MB) -n 32 \
			--prompt "$$(head -c 1200 $$held)" --prompt-tokens 200 $$t --trace $$p \
			--out $(BENCH_DIR)/trained-$$s || exit 1; \
	done; \
	for k in "--experts-used 3" "--experts-used 2" "--experts-used 1" \
		"--substitute 1 --cache-mb 6 --force-cache --chunks 40" "--substitute 4 --cache-mb 6 --force-cache --chunks 40"; do \
		echo "== the trained KJV model's held-out perplexity, $$k"; \
		target/release/sluice perplexity --model $$model --file $$held --ctx 256 $$k 2>/dev/null | tail -4 || exit 1; \
	done
	@$(MAKE) --no-print-directory bench-board-trained

# make bench-board: the board owner's first number, Qwen3-30B-A3B on a Raspberry Pi 5 8 GB (and a
# Jetson Orin Nano 8 GB), on the routes recorded from the real model (BOARD_ROUTES): see
# scripts/bench-board. The ~17.9 GB model is made once in BOARD_DIR (the disk's room is checked
# first). Needs root (memory cgroups, the read throttle); about an hour on a quiet machine. Not
# in make test; its small shape is (runtime/tests/memory.rs).
BOARD_DIR ?= $(BENCH_DIR)/board
BOARD_ROUTES ?= $(CURDIR)/../shared/traces/bigmoeonedge-2026-07-15/qwen.route.csv

bench-board: vendor
	$(CARGO) build --release --bin sluice
	@test -f $(BOARD_ROUTES) || { echo "make bench-board: no recorded routes at $(BOARD_ROUTES); set BOARD_ROUTES"; exit 1; }
	scripts/bench-board target/release/sluice $(BOARD_DIR) $(BOARD_ROUTES)

# make bench-board-120b: gpt-oss-120b's shape (36 layers of 128 experts of 13.2 MB, the published
# Q4_K_M file's types, ~63 GB) on its recorded routes (2 experts a token as recorded, of the 4
# native), in the same boards' cgroups: $(BOARD_DIR)/gpt-oss-120b/results.csv. The disk's room is
# checked first (the Qwen3 shape's file can go). Not in make test; its small shape is a gate
# fixture (GptOssDrawn) and scripts/bench-board's gpt-oss-small.
BOARD_120B_ROUTES ?= $(CURDIR)/../shared/traces/bigmoeonedge-2026-07-15/gptoss.route.csv

bench-board-120b: vendor
	$(CARGO) build --release --bin sluice
	@test -f $(BOARD_120B_ROUTES) || { echo "make bench-board-120b: no recorded routes at $(BOARD_120B_ROUTES); set BOARD_120B_ROUTES"; exit 1; }
	scripts/bench-board target/release/sluice $(BOARD_DIR)/gpt-oss-120b $(BOARD_120B_ROUTES) gpt-oss-120b

# make bench-board-trained: the board-shaped model trained here (make trained-model-board: 128
# experts a layer, 8 routed, 2.0 MiB experts, its own router making the routes) in a cgroup where
# its automatic cache holds a third of its experts (681 of 2,052 MiB), at 85, 400, 780 and 2,000
# MB/s: see scripts/bench-trained-board; $(BOARD_DIR)/trained-board/results.csv. Needs root;
# about 25 minutes on a quiet machine, after the model's training (about 35 minutes, once).
TRAINED_BOARD_BUDGET_MB ?= 800

bench-board-trained: vendor
	$(CARGO) build --release --bin sluice
	@model=$$(SLUICE=target/release/sluice trainer/make-model board | tail -1); \
	scripts/bench-trained-board target/release/sluice $(BOARD_DIR)/trained-board $$model $(TRAINED_BOARD_BUDGET_MB)

# make bench-pull: `sluice pull` against curl from the same loopback server (nginx, installed
# here), and the page cache of a served model beside each in a small board's memory cgroup: see
# scripts/pull-bench. Root; ~3 GB of disk in BENCH_DIR/pull; a few minutes.
bench-pull: vendor
	$(CARGO) build --release --bin sluice
	@scripts/ensure-deps nginx-light bc util-linux curl
	scripts/pull-bench $(CURDIR)/target/release/sluice $(CURDIR)/$(BENCH_DIR)/pull 2GiB 3

# Not part of make test: ~25 minutes, and ~530 MB of CUDA wheels from PyPI.
cuda-check: vendor
	@scripts/ensure-deps $(BUILD_DEBS) binutils
	@scripts/cuda-check

lint: vendor
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

clean:
	$(CARGO) clean
