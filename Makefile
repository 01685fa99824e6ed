# Two entry points (see README): `make demo` runs the main job on the local store, `make test` runs
# the whole test suite. Both install what they need on a fresh Debian 12 machine (as root).

VENV      ?= .venv
# Debian's own python3 (3.11.2 on Debian 12), so that the suite runs on what a fresh machine has.
PYTHON    ?= /usr/bin/python3
PY        := $(VENV)/bin/python
DSECFS    := $(VENV)/bin/dsecfs
APT_PKGS  := python3-venv python3-dev gcc erofs-utils mmdebstrap fuse3 libfuse3-dev libfuse2 pkg-config runc zstd attr acl chromium strace docker-registry skopeo apache2-utils containerd
ROOTFS    ?= /var/cache/dsecfs-test/debian-minbase
STORE     ?= /var/lib/dsecfs/store
DEMO_DIR  ?= /tmp/dsecfs-demo
PYTEST_ARGS ?=

.PHONY: setup apt venv test demo

setup: apt venv

# A fresh machine may be running apt itself when this starts (seen: `apt-get update` refused with "Could not
# get lock /var/lib/apt/lists/lock"): wait for its locks, and try again a few times.
apt:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		for try in 1 2 3 4 5 6 7 8 9 10 11 12; do \
			apt-get -o DPkg::Lock::Timeout=300 update -qq && \
			DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq $$missing >/dev/null && \
			exit 0; \
			echo "apt-get failed (try $$try of 12; another apt may hold its lock): trying again in 10 s"; sleep 10; \
		done; exit 1; \
	fi

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

$(ROOTFS):
	mkdir -p $(dir $(ROOTFS))
	rm -rf $(ROOTFS).tmp
	mmdebstrap --quiet --variant=minbase bookworm $(ROOTFS).tmp
	mv $(ROOTFS).tmp $(ROOTFS)

test: setup $(ROOTFS)
	$(VENV)/bin/pytest -q -ra $(PYTEST_ARGS)

# The main job on the embedded default (a local directory store): the whole system, docs/demo.sh. Build
# the real Debian rootfs and a toolkit into layers, check them; `sandbox up` starts a node daemon that
# mounts them lazily, commands run in the sandbox, the daemon shows how much it fetched; stop, write a
# trace report; export the layer and mount it with the kernel's EROFS driver alone.
demo: setup $(ROOTFS)
	DSECFS=$(abspath $(DSECFS)) PYTHON=$(abspath $(PY)) ROOTFS=$(ROOTFS) STORE=$(STORE) DEMO_DIR=$(DEMO_DIR) \
		sh docs/demo.sh
