#!/usr/bin/env bash
# Local Airflow 3 running iotlake's DAGs (`make airflow`): `airflow standalone` (api-server,
# scheduler, dag-processor, triggerer) with SQLite under <data_root>/airflow.
#
# Env knobs: IOTLAKE_CONFIG (settings file; default ./iotlake.toml), AIRFLOW_PORT (18080),
# AIRFLOW_PARALLELISM (2: the machine has 2 cores and Spark needs them too), AIRFLOW_HOME.
# Ports differ from Airflow's defaults (8080/8793/8794) so a machine-wide Airflow can coexist.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$REPO/.venv/bin"
cd "$REPO"

# Your fleet (./iotlake.toml), else the example sensor fleet `make run` simulates
if [[ -z "${IOTLAKE_CONFIG:-}" ]]; then
  if [[ -f "$REPO/iotlake.toml" ]]; then export IOTLAKE_CONFIG="$REPO/iotlake.toml"
  else export IOTLAKE_CONFIG="$REPO/examples/sensor.toml"; fi
fi
# Resolve data_root and the suite file once, here: tasks run with another working directory, so
# relative paths would point elsewhere. IOTLAKE_DATA_ROOT (and the suite's variable) pin them.
DATA_ROOT="$("$BIN/python" -c 'from lakehouse.settings import load_settings; print(load_settings().root)')"
export IOTLAKE_DATA_ROOT="$DATA_ROOT"
SUITE="$("$BIN/python" -c 'from pathlib import Path; from lakehouse.settings import load_settings
s = load_settings().telemetry.suite; print(Path(s).resolve() if s else "")')"
if [[ -n "$SUITE" ]]; then export IOTLAKE_TELEMETRY__SUITE="$SUITE"; fi
export PATH="$BIN:$PATH"

PORT="${AIRFLOW_PORT:-18080}"
export AIRFLOW_HOME="${AIRFLOW_HOME:-$DATA_ROOT/airflow}"
export AIRFLOW__CORE__DAGS_FOLDER="$REPO/dags"
export AIRFLOW__CORE__LOAD_EXAMPLES=False
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="sqlite:///$AIRFLOW_HOME/airflow.db"
export AIRFLOW__CORE__EXECUTOR=LocalExecutor
export AIRFLOW__CORE__PARALLELISM="${AIRFLOW_PARALLELISM:-2}"
export AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG="${AIRFLOW_PARALLELISM:-2}"
export AIRFLOW__API__HOST=127.0.0.1
export AIRFLOW__API__PORT="$PORT"
export AIRFLOW__API__WORKERS=1
export AIRFLOW__CORE__EXECUTION_API_SERVER_URL="http://127.0.0.1:$PORT/execution/"
export AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT="${AIRFLOW_WORKER_LOG_PORT:-18793}"
export AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT="${AIRFLOW_TRIGGER_LOG_PORT:-18794}"
export AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL=30

mkdir -p "$AIRFLOW_HOME"
"$BIN/airflow" db migrate >"$AIRFLOW_HOME/db-migrate.log" 2>&1 \
  || { tail -20 "$AIRFLOW_HOME/db-migrate.log" >&2; exit 2; }

echo "iotlake Airflow: http://127.0.0.1:$PORT  (AIRFLOW_HOME=$AIRFLOW_HOME, DAGs from $REPO/dags)"
echo "login: admin; password in $AIRFLOW_HOME/simple_auth_manager_passwords.json.generated"
exec "$BIN/airflow" standalone
