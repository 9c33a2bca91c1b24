#!/usr/bin/env bash
# Create iotlake's topics on a real Kafka (idempotent). The telemetry topic's partition count is
# the bronze stream's parallelism: one Spark task per partition per micro-batch (more with
# stream.kafka_split_records). Partitions can be added later (`--alter --partitions N`): the
# bronze source picks new partitions up from offset 0; records of one device stay ordered only
# within a partition, which silver does not rely on (it orders by event time).
# Reference only (used by infra/docker-compose.yml; no container engine in CI here).
set -euo pipefail
BOOTSTRAP="${BOOTSTRAP:-kafka:9092}"
PARTITIONS="${PARTITIONS:-8}"
TOPICS=/opt/kafka/bin/kafka-topics.sh
for i in $(seq 1 60); do
  "$TOPICS" --bootstrap-server "$BOOTSTRAP" --list >/dev/null 2>&1 && break
  sleep 2
done
"$TOPICS" --bootstrap-server "$BOOTSTRAP" --create --if-not-exists --topic telemetry \
  --partitions "$PARTITIONS" --replication-factor 1 --config retention.ms=604800000
"$TOPICS" --bootstrap-server "$BOOTSTRAP" --create --if-not-exists --topic telemetry-dlq \
  --partitions 1 --replication-factor 1
"$TOPICS" --bootstrap-server "$BOOTSTRAP" --describe --topic telemetry
