"""Parse raw bronze payloads into silver's typed columns, as the telemetry model says.

Each field is read from its path in the JSON payload (``lakehouse.telemetry``). The payload is
parsed once into a struct of the model's fields, metrics typed (``payload_struct``). A payload
that does not fit it (a value of another type or shape, a number in quotes, not JSON) is parsed
into a map of its top-level members instead, a nested field read from its member with a JSON
path, with the same result, but for payloads no device should send: a name sent twice (the
struct keeps the last, the map and JSON paths the first) and a number beyond a double's range
(at the top level: infinity in the struct, as nested, where the map holds the text "Infinity",
a wrong type; nested where a string such as an id is read: the struct's text is "Infinity" in
quotes, the JSON path's without). Top-level fields the model does not read are kept as JSON
in ``extra``, so a device that sends a new field never fails: the map is parsed too unless the
payload's colons prove it holds no member the struct lacks (``only_known_members``; a payload
with an escape, or with any member the model does not read, nested ones too, is parsed both
ways). Parse problems become reasons, not exceptions: the row is routed to quarantine with them.

The device id comes from the payload, from the MQTT topic (the bridge's ``mqtt_topic`` header,
matched against ``telemetry.topic_pattern``), or from both: when both name a device and they
differ, the reading is quarantined with ``device_mismatch`` unless the model trusts the topic.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import DoubleType, LongType, MapType, StringType, StructField, StructType

from lakehouse.telemetry import TelemetryModel, topic_parts

SCHEMA_VERSION = 1
_PAYLOAD = MapType(StringType(), StringType())
_UNFIT = "__iotlake_unfit"  # the typed parse's corrupt-record column: the payload did not fit
_CAST = {"double": "double", "long": "bigint"}


def parse_checks(model: TelemetryModel) -> tuple[tuple[str, str], ...]:
    """Every parse reason with the payload field it checks; the quality log counts each per
    batch. ``not_json`` is checked on every row, the others only on rows that are JSON objects."""
    checks = [("not_json", "value"), ("missing_event_id", model.event_id_path or "event_id"),
              ("missing_ts", model.event_time_path), ("bad_ts", model.event_time_path)]
    if model.device_id_path and model.device_level is not None:
        checks.append(("device_mismatch", model.device_id_path))
    if model.require_registered:  # judged by silver's writer against the registry (silver.stream)
        checks.append(("unknown_device", model.device_id_path or "device_id"))
    checks += [(f"wrong_type:{m.name}", m.source) for m in model.metrics]
    if model.schema_version_path:
        checks.append(("wrong_type:schema_version", model.schema_version_path))
    if model.sparkplug:
        checks += [("not_sparkplug", "value"), ("unknown_alias", "metrics")]
    return tuple(checks)


def _nonempty(c: Column) -> Column:
    return c.isNotNull() & (F.length(F.trim(c)) > 0)


def field(path: str) -> Column:
    """A payload field as a string (JSON text for objects and arrays; null when absent)."""
    top, *rest = path.split(".")
    c = F.col("_m")[top]
    if rest:
        c = F.get_json_object(c, "$" + "".join(f"['{s}']" for s in rest))
    return c


def payload_struct(model: TelemetryModel) -> StructType | None:
    """The model's payload fields as one struct at their paths: metrics typed, the other fields
    strings (JSON text for objects and numbers, as the map holds them). None when the paths cannot
    form one struct: a field that is also an object of others or read as two types, or names
    differing only in case (Spark's resolver cannot tell those apart)."""
    strings = [model.device_id_path, model.event_id_path, model.event_time_path, model.status_path,
               model.schema_version_path]
    fields = [(p, StringType()) for p in strings if p]
    fields += [(m.source, LongType() if m.type == "long" else DoubleType()) for m in model.metrics]
    tree: dict = {}
    for path, dtype in fields:
        *parents, leaf = path.split(".")
        node = tree
        for name in parents:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                return None
        if node.setdefault(leaf, dtype) != dtype:
            return None

    def struct(node: dict) -> StructType | None:
        children = {k: struct(v) if isinstance(v, dict) else v for k, v in node.items()}
        if len({k.lower() for k in node}) != len(node) or any(v is None for v in children.values()):
            return None
        return StructType([StructField(k, v) for k, v in children.items()])
    return struct(tree)


def _colons(c: Column) -> Column:
    return F.octet_length(c) - F.octet_length(F.replace(c, F.lit(":"), F.lit("")))


def only_known_members(text: Column, parsed: Column, struct: StructType) -> Column:
    """True where the payload ``text``, parsed into ``parsed`` (of ``struct``) and fitting it,
    has no member the struct lacks: as many colons as the struct's members found account for
    (one after each name, plus those in names and string values; a payload with an escape may
    hide a colon, and is never proven so). Counting characters instead of parsing the payload
    again (``json_object_keys``)."""
    return ~text.contains("\\") & (_colons(text) == _struct_colons(parsed, struct))


def _struct_colons(s: Column, struct: StructType) -> Column:
    """The colons a payload that fits ``struct`` and has no other member holds: one after each
    name, those in the names, and those in the string values (a nested value a string field
    holds is Spark's JSON text of it, its names' colons included)."""
    total = F.lit(0)
    for f in struct.fields:
        if f.name == _UNFIT:
            continue
        c = s[f.name]
        n = F.lit(1 + f.name.count(":"))
        if isinstance(f.dataType, StructType):
            n = n + _struct_colons(c, f.dataType)
        elif isinstance(f.dataType, StringType):
            n = n + _colons(c)
        total = total + F.when(c.isNotNull(), n).otherwise(0)
    return total


def _epoch_number(raw: Column) -> Column:
    # JSON numbers reach the payload map as their JSON text, e.g. 1.7640719405E9
    return F.when(raw.rlike(r"^\d+(\.\d+)?([eE][+-]?\d+)?$"), raw.try_cast("double"))


def _event_time(number: Column, fmt: str) -> Column:
    # each unit only within its own range (no overflow; years 1970 to ~5000)
    seconds = F.when(number < 1e11, F.timestamp_seconds(number))
    millis = F.when(number < 1e14, F.timestamp_micros((number * 1000).cast("long")))
    micros = F.when(number < 1e17, F.timestamp_micros(number.cast("long")))
    iso = F.expr("try_to_timestamp(_raw_ts)")
    if fmt == "iso8601":
        return iso
    if fmt == "epoch_s":
        return seconds
    if fmt == "epoch_ms":
        return millis
    if fmt == "epoch_us":
        return micros
    # auto: ISO-8601, or an epoch number whose magnitude tells its unit (from 1973 on: below
    # 1e11 seconds, below 1e14 milliseconds, below 1e17 microseconds)
    return F.coalesce(iso, F.when(number < 1e11, seconds).when(number < 1e14, millis).otherwise(micros))


def mqtt_topic() -> Column:
    """A bronze record's MQTT topic: the bridge's ``mqtt_topic`` header (its first), else null."""
    first = F.get(F.col("headers"), 0)
    return F.when(first["key"] == "mqtt_topic", first["value"].cast("string"))


def topic_levels(model: TelemetryModel) -> Column | None:
    """The bronze record's MQTT topic split into its levels when it matches the model's topic
    pattern (as many levels, the literal ones equal, the named ones not empty), else null; None
    when the pattern names no part. (A split on "/": a regular expression per named part costs
    several times as much per row.)"""
    if not topic_parts(model.topic_pattern):
        return None
    pattern = model.topic_pattern.split("/")
    levels = F.split(mqtt_topic(), "/")
    fits = F.size(levels) == len(pattern)
    for i, level in enumerate(pattern):
        at = F.try_element_at(levels, F.lit(i + 1))
        fits &= (at != "") if topic_parts(level) else (at == level)
    return F.when(fits, levels)


def topic_device(model: TelemetryModel, levels: Column | None = None) -> tuple[Column | None, dict[str, Column]]:
    """(device id, {topic part: value}) from the bridge's ``mqtt_topic`` header (the first header
    it writes) as ``topic_levels`` splits it (``levels``: that column, computed once); nulls when
    the record has no such header or its topic does not match."""
    if levels is None:
        levels = topic_levels(model)
    if levels is None:
        return None, {}
    parts = {topic_parts(level)[0]: levels[i] for i, level in enumerate(model.topic_pattern.split("/"))
             if topic_parts(level)}
    return parts.pop("device_id", None), parts


def parse(bronze: DataFrame, model: TelemetryModel, keep: tuple[str, ...] = (),
          typed: bool = True) -> DataFrame:
    """Bronze rows -> typed columns + ``parse_reasons`` (comma-joined, "" when parseable);
    ``keep``: input columns passed through as they are. ``typed=False`` reads every payload
    from its map (the reference the typed parse is tested against).

    No higher-order functions with a lambda except for ``extra`` (only when a payload has more
    fields than the model reads): Spark interprets those row by row.
    """
    text = F.col("value").cast("string")
    struct = payload_struct(model) if typed else None
    if "headers" in bronze.columns:
        levels = topic_levels(model)
        if levels is not None:  # split once, read by every part
            bronze = bronze.withColumn("_levels", levels)
        from_topic, topic_cols = topic_device(model, F.col("_levels") if levels is not None else None)
    else:  # rows that did not come through Kafka: no topic
        from_topic, topic_cols = None, {n: F.lit(None).cast("string") for n in model.topic_columns}
    # Intermediate columns are computed once each (an expression used in several places would
    # be inlined into each; Spark runs from_json outside generated code, and each projection
    # holding one copies the row).
    known_fields = sorted(model.payload_fields())
    as_map = F.from_json(text, _PAYLOAD, {"mode": "PERMISSIVE"})
    if struct is None:
        df, fit = bronze.withColumn("_m", as_map), None
    else:
        # The struct's fields are null where the payload lacks them; a payload in which a value
        # has another type or shape (NaN, Infinity and numbers in quotes too) or that is not a
        # JSON object does not fit, and is read from the map, so both ways give the same values
        # and reasons. The map is parsed too unless the colons show that the payload has no
        # member the struct lacks (its unknown fields go to ``extra``): a count of characters
        # where ``json_object_keys`` would parse the payload a second time.
        df = bronze.withColumn("_s", F.from_json(text, struct.add(_UNFIT, StringType()), {
            "mode": "PERMISSIVE", "columnNameOfCorruptRecord": _UNFIT, "allowNonNumericNumbers": "false"}))
        fit = F.col("_s").isNotNull() & F.col("_s")[_UNFIT].isNull()
        df = df.withColumn("_m", F.when(~(fit & only_known_members(text, F.col("_s"), struct)), as_map))

    def in_struct(path: str) -> Column:
        c = F.col("_s")
        for name in path.split("."):
            c = c[name]
        return c

    def at(path: str) -> Column:
        """A payload field as a string: the struct's where the payload fits it, else the map's."""
        return field(path) if fit is None else F.when(fit, in_struct(path)).otherwise(field(path))

    df = (df.withColumn("_raw_ts", F.trim(at(model.event_time_path)))
          .withColumn("_topic_device", from_topic if from_topic is not None else F.lit(None).cast("string")))
    df = df.withColumn("_num", _epoch_number(F.col("_raw_ts")))
    df = df.withColumn("_time", _event_time(F.col("_num"), model.event_time_format))
    # An event time no device clock can produce is unparseable (``bad_ts``): before the epoch, or
    # more than a day after bronze received the record (relative to ingest_time, so a replay routes
    # it the same). Kept, it would advance the watermark for everyone (later readings quarantined
    # as late) and overflow pandas' nanosecond timestamps in gold (a crash on every restart).
    # (in microseconds: adding a day interval to a timestamp goes through a ZonedDateTime per row)
    df = df.withColumn("_time", F.when(F.unix_micros("_time").between(
        F.lit(0), F.unix_micros("ingest_time") + F.lit(86_400_000_000)), F.col("_time")))
    m = F.col("_m")
    is_json = m.isNotNull() if fit is None else fit | m.isNotNull()
    ts = F.col("_raw_ts")
    event_time = F.col("_time")
    from_topic = F.col("_topic_device") if from_topic is not None else None
    metrics, wrong = {}, {}
    for mt in model.metrics:
        raw = field(mt.source)
        value = raw.try_cast(_CAST[mt.type])
        wrong[mt.name] = raw.isNotNull() & value.isNull()
        if fit is not None:  # CASE WHEN: the map's values only on rows that do not fit
            value = F.when(fit, in_struct(mt.source)).otherwise(value)
            wrong[mt.name] = F.when(fit, F.lit(False)).otherwise(wrong[mt.name])
        metrics[mt.name] = value

    from_payload = at(model.device_id_path) if model.device_id_path else None
    mismatch = (from_payload.isNotNull() & from_topic.isNotNull() & (from_payload != from_topic)) \
        if from_payload is not None and from_topic is not None else None
    if from_payload is None:
        device_id = from_topic
    elif from_topic is None:
        device_id = from_payload
    elif model.on_device_mismatch == "trust_topic":
        device_id = F.coalesce(from_topic, from_payload)
    else:
        device_id = F.coalesce(from_payload, from_topic)
    df = df.withColumn("_device", device_id if device_id is not None else F.lit(None).cast("string"))
    device_id = F.col("_device")
    if model.event_id_path:
        event_id = at(model.event_id_path)
    else:  # no id in the payload: the same device and raw payload are the same event (one
        # column: inside CASE WHEN, Spark would compute the digest once per use)
        df = df.withColumn("_event_id", F.when(device_id.isNotNull(), F.md5(F.concat(
            F.encode(device_id, "UTF-8"), F.lit(b"\x00"), F.col("value")))))
        event_id = F.col("_event_id")
    version = (at(model.schema_version_path).try_cast("int") if model.schema_version_path
               else F.lit(None).cast("int"))

    reasons = [
        F.when(~is_json, F.lit("not_json")),
        F.when(is_json & ~_nonempty(event_id), F.lit("missing_event_id")),
        F.when(is_json & ~_nonempty(ts), F.lit("missing_ts")),
        F.when(_nonempty(ts) & event_time.isNull(), F.lit("bad_ts")),
    ]
    if mismatch is not None and model.on_device_mismatch == "quarantine":
        reasons.append(F.when(mismatch, F.lit("device_mismatch")))
    reasons += [F.when(wrong[n], F.lit(f"wrong_type:{n}")) for n in model.metric_names]
    if model.schema_version_path:
        reasons.append(F.when(at(model.schema_version_path).isNotNull() & version.isNull(),
                              F.lit("wrong_type:schema_version")))
    # Unknown fields are rare: filter the map only when it holds more than the known fields found.
    known = sum((m[k].isNotNull().cast("int") for k in known_fields), F.lit(0))
    extra = F.when(F.size(m) > known, F.map_filter(m, lambda k, _: ~k.isin(*known_fields)))
    status = at(model.status_path) if model.status_path else F.lit(None).cast("string")
    return df.select(
        F.col("value"), F.col("topic").alias("kafka_topic"),
        F.col("partition").alias("kafka_partition"), F.col("offset").alias("kafka_offset"),
        F.col("ingest_time"),
        event_id.alias("event_id"),
        device_id.alias("device_id"),
        event_time.alias("event_time"),
        *[metrics[n].alias(n) for n in model.metric_names],
        *[c.alias(n) for n, c in topic_cols.items()],
        status.alias("status"),
        F.coalesce(version, F.lit(SCHEMA_VERSION)).alias("schema_version"),
        F.when(F.size(extra) > 0, F.to_json(extra)).alias("extra"),
        F.concat_ws(",", *reasons).alias("parse_reasons"),
        *keep,
    )
