"""Remember what py4j resolved a JVM name to (``spark._jvm.org.apache...``), per process.

py4j resolves a dotted name one segment per round trip to the JVM, every time it is used, and
the JVM answers each package segment (``org``, ``org.apache``, ``io.delta`` ...) by failing to
load a class of that name from every jar on the class path, also once per wildcard import of
pyspark's gateway for a short name. pyspark, delta-spark's Python API and our Delta commits do
that for every column, MERGE and commit (a profile of ``iotlake run`` found them among its
driver's busiest calls). A package or class name resolves the same way for the life of the
gateway (the jars and pyspark's imports are fixed at its start), so the first answer is kept on
the object that asked: the next use is an attribute read, without a round trip.
"""

from __future__ import annotations

from py4j import java_gateway

_installed = False


def remember_jvm_names() -> None:
    """Make ``JVMView`` and ``JavaPackage`` keep each package or class they resolve (idempotent)."""
    global _installed
    if _installed:
        return
    for cls in (java_gateway.JVMView, java_gateway.JavaPackage):
        cls.__getattr__ = _remembering(cls.__getattr__)
    _installed = True


def _remembering(resolve):
    def __getattr__(self, name: str):
        found = resolve(self, name)
        if isinstance(found, (java_gateway.JavaPackage, java_gateway.JavaClass)):
            self.__dict__[name] = found  # found by normal attribute lookup from now on
        return found

    return __getattr__
