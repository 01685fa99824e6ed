# Two entry points (see README): `make demo` runs the main job on the local store, `make test` runs
# the whole test suite. Both install what they need on a fresh Debian 12 machine (as root).

VENV      ?= .venv
PY        := $(VENV)/bin/python
DSECFS    := $(VENV)/bin/dsecfs
APT_PKGS  := erofs-utils mmdebstrap fuse3 libfuse3-dev libfuse2 pkg-config runc zstd attr acl chromium strace docker-registry skopeo apache2-utils containerd
ROOTFS    ?= /var/cache/dsecfs-test/debian-minbase
STORE     ?= /var/lib/dsecfs/store
DEMO_DIR  ?= /tmp/dsecfs-demo
PYTEST_ARGS ?=

.PHONY: setup apt venv test demo

setup: apt venv

apt:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
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

# The main job on the embedded default (a local directory store): build the real Debian rootfs into a
# layer, check it, export it and mount it with the kernel's EROFS driver, and show what was stored.
demo: setup $(ROOTFS)
	$(DSECFS) build $(ROOTFS) --store $(STORE) --name base/debian:12
	$(DSECFS) inspect base/debian:12 --store $(STORE)
	$(DSECFS) fsck base/debian:12 --store $(STORE)
	rm -rf $(DEMO_DIR) && mkdir -p $(DEMO_DIR)/mnt
	$(DSECFS) export base/debian:12 $(DEMO_DIR)/export --store $(STORE)
	$(DSECFS) extract base/debian:12 $(DEMO_DIR)/extract --store $(STORE)
	$(DSECFS) mount-export $(DEMO_DIR)/export $(DEMO_DIR)/mnt -- chroot $(DEMO_DIR)/mnt /usr/bin/dpkg-query -W -f '$${Package}\n' | wc -l
	@echo "extracted tree: $$(find $(DEMO_DIR)/extract | wc -l) entries, $$(du -sh --apparent-size $(DEMO_DIR)/extract | cut -f1)"
