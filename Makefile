# cachefs: the two quick-start commands are `make lab` and `make test`.
# Both install what they need (Debian/Ubuntu packages, a venv) when missing.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# systemd: systemd-analyze and its fstab generator check the unit files (tests/core/test_units.py);
# prometheus (promtool too) and stress-ng: a real Prometheus scrapes the lab (tests/lab/test_observability.py,
# test_lab_prometheus.py), stress-ng and dbench load a mount (tests/client/test_stress.py; dbench also in
# bench.meta_fs_bench); without them those skip
APT_PACKAGES := fuse3 libfuse3-dev pkg-config fio iproute2 nftables openssl python3-pyverbs systemd prometheus stress-ng dbench
PYTEST_ARGS ?=
# Test worker processes (pytest-xdist): most of the suite waits on real daemons, disks and timers,
# not on the CPU, so two workers overlap those waits even on two cores (see tests/conftest.py).
TEST_WORKERS ?= 2
# The CPU build of torch that lies on this machine's disk: installed before the
# project, it satisfies the torch extra's range, so pip downloads no other build.
TORCH  ?= torch==2.13.0

.PHONY: setup deps venv rdma test lint lab lab-down bench clean

setup: deps venv rdma

deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing: $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip uninstall -q -y cachefs 2>/dev/null || true  # the distribution's name before cachefs-ai
	$(BIN)/pip install -q '$(TORCH)'
	$(BIN)/pip install -q -e '.[dev,torch,bench]'
	touch $@

# pyverbs: PyPI's pyverbs does not build against Debian 12's rdma-core, so we
# use Debian's python3-pyverbs and make only its package visible to the venv.
rdma: venv
	@src=$$(dpkg -L python3-pyverbs 2>/dev/null | grep -m1 '/pyverbs$$'); \
	if [ -n "$$src" ]; then \
		mkdir -p $(VENV)/rdma-site && ln -sfn $$src $(VENV)/rdma-site/pyverbs; \
		$(BIN)/python -c 'import site,sys; print(sys.prefix + "/rdma-site")' \
			> $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/cachefs-rdma.pth; \
	else echo "python3-pyverbs not installed: RDMA transport unavailable (TCP only)"; fi

# Bytecode caching on even where the environment turns it off: the suite starts
# its daemons and CLIs hundreds of times, and each import of ours from .pyc
# costs about 30% less CPU than compiling the sources again.
test: setup
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check cachefs metanode datanode cachenode client bench tests

lab: setup
	$(BIN)/cachefs lab up --dir /tmp/cachefs-lab --mount /mnt/cachefs --workload

lab-down: venv
	$(BIN)/cachefs lab down --dir /tmp/cachefs-lab

bench: setup
	$(BIN)/python -m bench.rpc_bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
