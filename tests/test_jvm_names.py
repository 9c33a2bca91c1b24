"""``lakehouse.runtime.jvm_names``: py4j keeps what a JVM name resolved to, and the names still work."""

from __future__ import annotations

from py4j.java_gateway import JavaClass, JavaPackage


def test_a_resolved_jvm_name_is_kept_and_still_works(spark) -> None:
    jvm = spark._jvm
    first = jvm.org.apache.spark.sql.delta.DeltaLog
    assert isinstance(first, JavaClass)
    assert jvm.org.apache.spark.sql.delta.DeltaLog is first  # no second round trip
    assert isinstance(jvm.__dict__["org"], JavaPackage)
    assert jvm.java.lang.Math.max(3, 7) == 7
    assert jvm.java.lang.Long.valueOf(5) == 5
    assert getattr(jvm, "org.apache.spark.sql.functions") is getattr(jvm, "org.apache.spark.sql.functions")
    assert str(jvm.scala.Some(1)) == "Some(1)"
