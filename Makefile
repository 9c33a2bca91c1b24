# iotlake — two commands for a newcomer: `make run` and `make test`.
# Each creates .venv if missing, installs the package and the system packages it needs
# (Mosquitto; Java and Maven), resolves the pinned jars (Delta, Spark's Kafka connector, the
# Kafka broker) from Maven Central into .jars/ and starts the embedded brokers on iotlake's own ports.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Airflow (the `airflow` extra: the DAGs) on top of the install, for `make airflow` and the tests
AIRFLOW_STAMP := $(VENV)/.installed-airflow
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
RATE   ?= 200
DEVICES ?= 50
# The fleet run and demo simulate: yours (./iotlake.toml or $$IOTLAKE_CONFIG), else the example sensor
CONFIG ?= $(or $(IOTLAKE_CONFIG),$(wildcard iotlake.toml),examples/sensor.toml)

.PHONY: run demo archive test test-deps bench lint airflow dashboard install system-deps jars constraints clean
JARS   := .jars
CDS    := $(JARS)/cds/spark-driver.jsa
KAFKA_CDS := $(JARS)/cds/kafka-broker.jsa
# A Sparkplug B edge node for the tests: Eclipse Tahu's protocol spoken by a library not ours
# (pysparkplug). It pins paho-mqtt<2, iotlake uses paho-mqtt 2: a venv of its own.
EDGE_VENV  := .venv-edge
EDGE_STAMP := $(EDGE_VENV)/.installed
MVN    := mvn -q -B

run: install $(CDS) $(KAFKA_CDS) ## live pipeline on embedded Mosquitto + Apache Kafka, simulated devices; Ctrl-C stops
	$(BIN)/iotlake --config $(CONFIG) run --simulate $(RATE) --devices $(DEVICES)

demo: install $(CDS) $(KAFKA_CDS) ## bounded run: publish events, wait for gold, print accounting JSON
	$(BIN)/iotlake --config $(CONFIG) demo --events 5000 --devices 20

test: install $(AIRFLOW_STAMP) test-deps $(EDGE_STAMP) $(KAFKA_CDS) ## the whole test suite (real brokers, real Spark, real Delta files)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=40

lint: install
	$(BIN)/ruff check .

# Python packages and jars download side by side.
install: system-deps
	@$(MAKE) --no-print-directory -j2 $(STAMP) jars

# JVM dependencies, pinned in infra/jvm/*.pom.xml, copied from Maven Central into .jars/ (git-ignored)
jars: $(JARS)/spark/.resolved $(JARS)/kafka/.resolved

$(JARS)/spark/.resolved: infra/jvm/spark-jars.pom.xml | system-deps
	rm -rf $(JARS)/spark
	$(MVN) -f $< dependency:copy-dependencies -DoutputDirectory=$(CURDIR)/$(JARS)/spark
	@touch $@

$(JARS)/kafka/.resolved: infra/jvm/kafka-broker.pom.xml | system-deps
	rm -rf $(JARS)/kafka
	$(MVN) -f $< dependency:copy-dependencies -DoutputDirectory=$(CURDIR)/$(JARS)/kafka
	@touch $@

# The Spark driver's class archive (a short demo run records the classes it loads): every later
# Spark process starts ~10% cheaper (bench/jvm_startup.py). Rebuilt when the jars change. Built
# for run, demo and bench, not for test: recording takes ~90 s, more than the suite saves with it.
archive: $(CDS)         ## record the Spark driver's class archive now (make run does it once)

# The embedded broker's class archive (one broker start, ~10 s): every later broker starts in
# ~40% less time and CPU. Built for test as well.
$(KAFKA_CDS): $(JARS)/kafka/.resolved | $(STAMP)
	$(BIN)/python infra/jvm/class_archive.py kafka $@

$(CDS): $(JARS)/spark/.resolved $(JARS)/kafka/.resolved | $(STAMP)
	$(BIN)/python infra/jvm/class_archive.py spark $@

# uv installs the pinned set (infra/python/constraints.txt) in half pip's time
$(STAMP): pyproject.toml infra/python/constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q 'uv>=0.9,<1'
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -c infra/python/constraints.txt -e '.[dev]' -C editable_mode=compat
	@# pyspark ships as an sdist; where the index's answers come back stale, uv rebuilds it on
	@# every install and keeps each build (~1.4 GB). Prune keeps only what is in use.
	$(BIN)/uv cache prune -q
	@touch $(STAMP)

$(AIRFLOW_STAMP): pyproject.toml infra/python/constraints.txt | $(STAMP)
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -c infra/python/constraints.txt -e '.[dev,airflow]' -C editable_mode=compat
	@touch $@

constraints: $(STAMP) $(AIRFLOW_STAMP)   ## re-pin infra/python/constraints.txt to what .venv holds (after a passing make test)
	{ sed -n '1,2p' infra/python/constraints.txt; $(BIN)/uv pip freeze --python $(BIN)/python --exclude-editable | grep -Ev '^(uv|pip|setuptools)=='; } > infra/python/constraints.tmp
	mv infra/python/constraints.tmp infra/python/constraints.txt

$(EDGE_STAMP): | $(STAMP)
	@test -x $(EDGE_VENV)/bin/python || $(PYTHON) -m venv $(EDGE_VENV)
	$(BIN)/uv pip install -q --python $(EDGE_VENV)/bin/python 'pysparkplug==0.6.1' 'paho-mqtt>=1.6,<2'
	@touch $@

system-deps:
	@missing=""; \
	command -v mosquitto >/dev/null 2>&1 || test -x /usr/sbin/mosquitto || missing="$$missing mosquitto"; \
	command -v java >/dev/null 2>&1 || missing="$$missing openjdk-17-jre-headless"; \
	command -v mvn >/dev/null 2>&1 || missing="$$missing maven"; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi

test-deps:              ## headless Chromium (dashboard test), mosquitto_sub and kcat (the bridge bench's baseline; make bench needs them too), Alertmanager and promtool (alert delivery, infra/prometheus rules)
	@missing=""; \
	command -v chromium >/dev/null 2>&1 || test -x /usr/bin/chromium || missing="$$missing chromium fonts-liberation"; \
	command -v mosquitto_sub >/dev/null 2>&1 || missing="$$missing mosquitto-clients"; \
	command -v kcat >/dev/null 2>&1 || missing="$$missing kcat"; \
	test -x /usr/bin/prometheus-alertmanager || missing="$$missing prometheus-alertmanager"; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	if [ -n "$$missing" ]; then \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi

bench: install $(CDS) $(KAFKA_CDS) test-deps ## all benchmarks but the long chaos and soak runs (each prints a last JSON line)
	for b in bench/*.py; do case $$b in */_*|*/nab_scoring.py|*/chaos_harness.py|*/procs.py|*/fleets.py|*/spark_cpu.py|*/chaos.py|*/soak.py) continue;; esac; echo "== $$b"; $(BIN)/python $$b; done

airflow: install $(AIRFLOW_STAMP) ## local Airflow (SQLite, our DAGs) under <data_root>/airflow
	bash infra/airflow.sh

dashboard: install      ## ops dashboard on http://127.0.0.1:8050
	$(BIN)/iotlake dashboard

clean:
	rm -rf data .pytest_cache $(JARS) $(EDGE_VENV)
