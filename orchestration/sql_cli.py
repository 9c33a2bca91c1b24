"""``iotlake sql``: Spark SQL over the lakehouse tables, for queries too heavy for DuckDB.

Every table is a temp view over ``spark.read.format("delta")`` (delta-spark) at a pinned
``versionAsOf``, under the same names as ``iotlake query``. Versions are resolved when the
session starts (delta-rs, no Spark job): every statement of a session sees one consistent
snapshot, and ``--as-of-*`` applies to all tables. A statement reads those tables and nothing
else on disk (``orchestration/sql_confine.py``) unless ``--allow-files``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

import pyarrow as pa
from pyspark.sql import SparkSession

from lakehouse.settings import Settings
from lakehouse.tables import TABLES
from orchestration.query import QueryError, open_table, referenced_tables
from orchestration.query_cli import add_read_options, format_table
from orchestration.sql_confine import RUN_SQL_ON_FILES, Confinement, Refused

# Literals, quoted identifiers and comments (unterminated ones run to the end: an unfinished
# statement at the prompt), a ';', or anything else.
_TOKENS = re.compile(r"""'(?:[^'\\]|\\.)*'?|"(?:[^"\\]|\\.)*"?|`[^`]*`?|--[^\n]*|/\*.*?(?:\*/|\Z)"""
                     r"""|;|[^;'"`/-]+|.""", re.S)
_COMMENTS = re.compile(r"--[^\n]*|/\*.*?(?:\*/|\Z)", re.S)


def split_statements(text: str) -> tuple[list[str], str]:
    """Statements ended by ``;`` (outside literals and comments), and the unfinished rest."""
    done: list[str] = []
    current: list[str] = []
    for tok in _TOKENS.findall(text):
        if tok == ";":
            stmt = "".join(current).strip()
            if _COMMENTS.sub("", stmt).strip():
                done.append(stmt)
            current = []
        else:
            current.append(tok)
    return done, "".join(current)


def _one_line(e: Exception) -> str:
    java = getattr(e, "java_exception", None)  # Py4JJavaError: "An error occurred while calling"
    lines = [x.strip() for x in str(java if java is not None else e).splitlines() if x.strip()]
    return lines[0] if lines else type(e).__name__


@contextmanager
def _quiet_pyspark_errors() -> Iterator[None]:
    """PySpark logs every SQL error with its context as JSON on stderr; we print one line."""
    from pyspark.logger import PySparkLogger

    logger = PySparkLogger.getLogger("SQLQueryContextLogger")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class SqlSession:
    """Every existing table registered in ``spark`` as a temp view at its pinned version."""

    def __init__(self, spark: SparkSession, settings: Settings, as_of_version: int | None = None,
                 as_of_timestamp: str | None = None, allow_files: bool = False) -> None:
        if as_of_version is not None and as_of_timestamp is not None:
            raise QueryError("give either as_of_version or as_of_timestamp, not both")
        self.versions: dict[str, int] = {}
        self.unreadable: dict[str, str] = {}  # table -> why (no data yet, no such version)
        for name in TABLES:
            try:
                self.versions[name] = open_table(settings, name, as_of_version,
                                                 as_of_timestamp).version()
            except QueryError as e:
                self.unreadable[name] = str(e)
        self.spark = spark
        roots: set[str] = set()
        for name, version in self.versions.items():
            path = settings.table_path(name)
            view = self.spark.read.format("delta").option("versionAsOf", str(version)).load(path)
            view.createOrReplaceTempView(name)
            roots |= Confinement.roots_of(view)
        # unless --allow-files, statements read the lake's tables only (orchestration/sql_confine)
        self._files_conf = spark.conf.get(RUN_SQL_ON_FILES)
        self.confinement = None if allow_files else Confinement(spark, roots, list(self.versions))

    def close(self) -> None:
        """Drop the views (the caller's session may live on, e.g. in tests)."""
        for name in self.versions:
            self.spark.catalog.dropTempView(name)
        self.spark.conf.set(RUN_SQL_ON_FILES, self._files_conf)

    def run(self, sql: str) -> pa.Table:
        """Run one statement; QueryError (one line) for bad SQL or a table that cannot be read."""
        from py4j.protocol import Py4JJavaError
        from pyspark.errors import AnalysisException, PySparkException
        from pyspark.errors.exceptions.captured import convert_exception

        for name in referenced_tables(sql):
            if name in self.unreadable:
                raise QueryError(self.unreadable[name])
        try:
            with _quiet_pyspark_errors():
                if self.confinement is None:
                    return self.spark.sql(sql).toArrow()
                try:
                    return self.confinement.run(sql).toArrow()
                except Py4JJavaError as e:  # the parser's or a command's: as spark.sql raises them
                    raise convert_exception(e.java_exception) from None
        except Refused as e:
            raise QueryError(str(e)) from None
        except AnalysisException as e:
            if e.getCondition() == "TABLE_OR_VIEW_NOT_FOUND":
                name = (e.getMessageParameters() or {}).get("relationName", "?").replace("`", "")
                known = ", ".join(self.versions) or "(none yet)"
                raise QueryError(f"unknown table '{name}'; known tables: {known}") from None
            raise QueryError(_one_line(e)) from None
        except (PySparkException, Py4JJavaError) as e:
            raise QueryError(_one_line(e)) from None


def execute(spark: SparkSession, settings: Settings, text: str, as_of_version: int | None = None,
            as_of_timestamp: str | None = None, fmt: str = "table",
            out: TextIO | None = None, err: TextIO | None = None, allow_files: bool = False) -> int:
    """Run the ``;``-separated statements in ``text`` and print each result; stops at the first
    failing one. Exit code: 0, or 2 with a one-line error."""
    out, err = out or sys.stdout, err or sys.stderr
    statements, rest = split_statements(text)
    if _COMMENTS.sub("", rest).strip():
        statements.append(rest.strip())
    if not statements:
        print("iotlake sql: no SQL statement given", file=err)
        return 2
    try:
        session = SqlSession(spark, settings, as_of_version, as_of_timestamp, allow_files)
    except QueryError as e:
        print(f"iotlake sql: {e}", file=err)
        return 2
    try:
        for stmt in statements:
            out.write(format_table(session.run(stmt), fmt))
    except QueryError as e:
        print(f"iotlake sql: {e}", file=err)
        return 2
    finally:
        session.close()
    return 0


def repl(session: SqlSession, fmt: str = "table", read: Callable[[str], str] = input,
         out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Interactive prompt: statements end with ``;``; errors are reported and the prompt goes on;
    ``exit``, ``quit`` or end of input leave."""
    out, err = out or sys.stdout, err or sys.stderr
    views = ", ".join(f"{n}@v{v}" for n, v in session.versions.items()) or "(none yet)"
    print(f"iotlake sql: views {views}\nEnd statements with ';'; exit with 'exit' or Ctrl-D.",
          file=err)
    buffer = ""
    while True:
        try:
            line = read("iotlake> " if not buffer.strip() else "     ...> ")
        except EOFError:
            break
        except KeyboardInterrupt:  # drop the unfinished statement, keep the prompt
            buffer = ""
            out.write("\n")
            continue
        if not buffer.strip() and line.strip().rstrip(";").lower() in ("exit", "quit", r"\q"):
            break
        statements, buffer = split_statements(buffer + line + "\n")
        for stmt in statements:
            try:
                out.write(format_table(session.run(stmt), fmt))
            except QueryError as e:
                print(f"error: {e}", file=err)
    return 0


def _interactive(session: SqlSession, fmt: str) -> int:
    if not sys.stdin.isatty():  # statements piped in: no prompts, no history
        return repl(session, fmt, read=lambda _prompt: input())
    try:
        import readline
    except ImportError:  # not on every platform; input() still works, without editing
        return repl(session, fmt)
    history = Path.home() / ".iotlake_sql_history"
    try:
        readline.read_history_file(history)
    except OSError:
        pass
    try:
        return repl(session, fmt)
    finally:
        try:
            readline.write_history_file(history)
        except OSError:
            pass


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Processes started inside (the JVM, hence Spark's Python workers) write their log lines
    to stderr: stdout carries results only (``iotlake sql -e ... --format csv > out.csv``)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _run(args: argparse.Namespace, settings: Settings) -> int:
    from lakehouse.spark import spark_session

    text = args.execute
    if args.file:
        try:
            text = Path(args.file).read_text()
        except OSError as e:
            print(f"iotlake sql: cannot read {args.file}: {e.strerror}", file=sys.stderr)
            return 2
    with _stdout_to_stderr():
        spark = spark_session(settings, app_name="iotlake-sql", batch=True)
    try:
        if text is not None:
            return execute(spark, settings, text, args.as_of_version, args.as_of_timestamp,
                           args.format, allow_files=args.allow_files)
        try:
            session = SqlSession(spark, settings, args.as_of_version, args.as_of_timestamp,
                                 args.allow_files)
        except QueryError as e:
            print(f"iotlake sql: {e}", file=sys.stderr)
            return 2
        return _interactive(session, args.format)
    finally:
        spark.stop()


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "sql", help="Spark SQL over the lakehouse tables (a prompt without -e/-f)",
        description="Run Spark SQL over the Delta tables, registered as views under their "
                    "logical names (as in `iotlake query`). With neither -e nor -f, opens a "
                    "prompt; statements end with ';'. Exit 2 on bad SQL or arguments.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-e", "--execute", metavar="SQL", help="statement(s) to run, ';'-separated")
    src.add_argument("-f", "--file", metavar="FILE", help="file of ';'-separated statements")
    add_read_options(p)
    p.add_argument("--allow-files", action="store_true",
                   help="let statements read paths, add jars and write tables (by default they "
                        "read the lake's tables only: exit 2 otherwise)")
    p.set_defaults(func=_run)
