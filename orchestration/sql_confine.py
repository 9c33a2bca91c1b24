"""What ``iotlake sql`` lets a statement do: read the lake's tables, touch nothing else on disk.

Spark SQL reads any path (``text.`/etc/hostname```, ``table_changes_by_path('/x', 0)``), loads
jars and files, writes tables and directories and calls JVM methods (``reflect``). A statement
is checked on the plan Spark's own parser gives, and that plan is what runs (no second parse):

- it is a query or one of a few read-only commands (SHOW, DESCRIBE, EXPLAIN, SET of a
  ``spark.sql.*`` option, CACHE, a temporary view);
- every relation is named by one name (the lake's views, a CTE, a temporary view): a
  qualified name is a path or another catalog's table;
- no table function but the built-in generators, no ``reflect`` / ``java_method``, no
  ``EXECUTE IMMEDIATE`` or ``IDENTIFIER(expr)`` (names known only at analysis);
- a query's analyzed plan reads files only at the lake's tables' roots.

``spark.sql.runSQLOnFiles=false``, set before each statement, is a second lock: Spark itself
then resolves no ``format.`path``` (Delta's catalog honours it too).
"""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession

#: Commands that read or only change the session (simple class names, Scala's ``$`` dropped).
COMMANDS = frozenset({
    "ShowTables", "ShowTablesExtended", "ShowViews", "ShowColumns", "ShowFunctions",
    "ShowNamespaces", "ShowCatalogs", "ShowTableProperties", "DescribeRelation", "DescribeColumn",
    "DescribeFunction", "DescribeQueryCommand", "ExplainCommand", "SetCommand", "ResetCommand",
    "CreateViewCommand", "CacheTable", "CacheTableAsSelect", "UncacheTable", "ClearCacheCommand",
})
#: Where a command keeps the query it analyzes (not always a child of the plan).
_INNER_QUERY = {"ExplainCommand": "logicalPlan", "DescribeQueryCommand": "plan"}
_QUERY_CHILDREN = frozenset({"CreateViewCommand", "CacheTableAsSelect"})
#: Plans that are no command but write, or whose names are known only at analysis.
_REFUSED = {
    "InsertIntoStatement": "INSERT", "InsertIntoDir": "INSERT OVERWRITE DIRECTORY",
    "UnresolvedExecuteImmediate": "EXECUTE IMMEDIATE", "ExecuteImmediateQuery": "EXECUTE IMMEDIATE",
    "PlanWithUnresolvedIdentifier": "IDENTIFIER(expression)",
    "DescribeDeltaHistory": "DESCRIBE HISTORY",
}
_NAMED = frozenset({"UnresolvedRelation", "UnresolvedTable", "UnresolvedTableOrView", "UnresolvedView"})
#: Spark's built-in table functions that read nothing (``range`` and the generators).
TABLE_FUNCTIONS = frozenset({
    "range", "explode", "explode_outer", "inline", "inline_outer", "json_tuple", "posexplode",
    "posexplode_outer", "stack", "collations", "sql_keywords", "variant_explode",
    "variant_explode_outer",
})
_JVM_FUNCTIONS = frozenset({"reflect", "java_method", "try_reflect"})
#: Leaves of an analyzed query that read no file.
_LEAVES = frozenset({"OneRowRelation", "LocalRelation", "Range", "CTERelationRef",
                     "ResolvedInlineTable", "EmptyRelation"})
#: ``SET key=value`` is for ``spark.sql.*`` options but these.
_LOCKED_OPTIONS = ("spark.sql.runSQLOnFiles", "spark.sql.catalog")

RUN_SQL_ON_FILES = "spark.sql.runSQLOnFiles"


class Refused(ValueError):
    """The statement does something ``iotlake sql`` does not allow; the message says what."""


def _seq(s) -> list:
    return [s.apply(i) for i in range(s.size())]


def _name(node) -> str:
    return node.getClass().getSimpleName().rstrip("$")


def _quoted(parts: list[str]) -> str:
    return ".".join(f"`{p}`" for p in parts)


class Confinement:
    """Checks and runs statements in ``spark`` so that they read only under ``roots`` (the root
    paths of the lake's views' relations, as Spark's analyzed plans name them)."""

    def __init__(self, spark: SparkSession, roots: set[str], tables: list[str]) -> None:
        self.spark, self.roots, self.tables = spark, roots, tables
        self._jss = spark._jsparkSession
        jvm = spark._jvm
        cls = jvm.java.lang.Class.forName
        self._command = cls("org.apache.spark.sql.catalyst.plans.logical.Command")
        self._plan = cls("org.apache.spark.sql.catalyst.plans.logical.LogicalPlan")
        self._subquery = jvm.java.lang.Class.forName("org.apache.spark.sql.catalyst.expressions.SubqueryExpression")
        self._ofrows = jvm.org.apache.spark.sql.classic.Dataset.ofRows

    @staticmethod
    def roots_of(frame: DataFrame) -> set[str]:
        """The root paths a frame's analyzed plan reads (for a view over a Delta table)."""
        out: set[str] = set()
        for leaf in _leaves(frame._jdf.queryExecution().analyzed()):
            if _name(leaf) == "LogicalRelation":
                out.update(p.toString() for p in _seq(leaf.relation().location().rootPaths()))
        return out

    def run(self, sql: str) -> DataFrame:
        """The statement's result; a command runs here, a query when the frame is collected.
        Raises ``Refused``, or the JVM's error for SQL that does not parse or analyze."""
        self.spark.conf.set(RUN_SQL_ON_FILES, "false")
        plan = self._jss.sessionState().sqlParser().parsePlan(sql)
        queries: list = []
        self._check(plan, queries)
        if not self._command.isInstance(plan):  # a query: analyzed once, checked, run as is
            ds = self._ofrows(self._jss, plan)
            self._check_reads(ds.queryExecution().analyzed())
            return DataFrame(ds, self.spark)
        for q in queries:  # the command's queries, analyzed before the command runs
            self._check_reads(self._ofrows(self._jss, q).queryExecution().analyzed())
        return DataFrame(self._ofrows(self._jss, plan), self.spark)

    # -- the parsed plan ------------------------------------------------------------------------

    def _check(self, plan, queries: list) -> None:
        name = _name(plan)
        if self._command.isInstance(plan):
            if name not in COMMANDS:
                raise Refused(f"{_statement(name)} is refused: iotlake sql runs queries and "
                              "SHOW / DESCRIBE / EXPLAIN / SET / CACHE / CREATE TEMPORARY VIEW over "
                              "the lake's tables")
            if name == "SetCommand":
                self._check_set(plan)
            if name == "CreateViewCommand" and "Temp" not in plan.viewType().toString():
                raise Refused("CREATE VIEW is refused: use CREATE TEMPORARY VIEW (the session's own)")
            if name in _INNER_QUERY:
                inner = getattr(plan, _INNER_QUERY[name])()
                if not self._command.isInstance(inner):
                    queries.append(inner)
                self._check(inner, queries)
            if name in _QUERY_CHILDREN:
                queries.extend(_seq(plan.children()))
        if name in _REFUSED:
            raise Refused(f"{_REFUSED[name]} is refused: iotlake sql reads the lake's tables only")
        if name in _NAMED:
            parts = [str(p) for p in _seq(plan.multipartIdentifier())]
            if len(parts) > 1:
                raise Refused(f"{_quoted(parts)} is refused: iotlake sql reads the lake's tables by "
                              f"name ({', '.join(self.tables) or 'none yet'}), not files or "
                              "other catalogs' tables")
        if name == "UnresolvedTableValuedFunction":
            fn = str(_seq(plan.name())[-1]).lower()
            if fn not in TABLE_FUNCTIONS:
                raise Refused(f"table function {fn}() is refused: iotlake sql reads the lake's "
                              "tables only (allowed: " + ", ".join(sorted(TABLE_FUNCTIONS)) + ")")
        for e in _seq(plan.expressions()):
            self._check_expression(e, queries)
        for child in _seq(plan.children()) + _seq(plan.innerChildren()):
            if self._plan.isInstance(child):  # inner children may be expressions or plans
                self._check(child, queries)
            else:
                self._check_expression(child, queries)

    def _check_expression(self, e, queries: list) -> None:
        name = _name(e)
        if name == "UnresolvedFunction":
            fn = str(_seq(e.nameParts())[-1]).lower()
            if fn in _JVM_FUNCTIONS:
                raise Refused(f"{fn}() is refused: it calls JVM methods")
        elif name == "ExpressionWithUnresolvedIdentifier":
            raise Refused("IDENTIFIER(expression) is refused: iotlake sql checks names before it runs")
        if self._subquery.isInstance(e):
            self._check(e.plan(), queries)
        for child in _seq(e.children()):
            self._check_expression(child, queries)

    def _check_set(self, plan) -> None:
        kv = plan.kv()
        if not kv.isDefined() or not kv.get()._2().isDefined():
            return  # SET, SET -v, SET key: shows
        key = str(kv.get()._1())
        if not key.startswith("spark.sql.") or key.startswith(_LOCKED_OPTIONS):
            raise Refused(f"SET {key} is refused: iotlake sql sets spark.sql.* options but "
                          f"{', '.join(k + '*' if k.endswith('catalog') else k for k in _LOCKED_OPTIONS)}")

    # -- the analyzed plan ----------------------------------------------------------------------

    def _check_reads(self, analyzed) -> None:
        for leaf in _leaves(analyzed):
            name = _name(leaf)
            if name in _LEAVES:
                continue
            if name == "LogicalRelation":
                try:
                    paths = {p.toString() for p in _seq(leaf.relation().location().rootPaths())}
                except Exception:  # noqa: BLE001 - a relation without files' location: not the lake's
                    paths = {"?"}
                if paths <= self.roots:
                    continue
                raise Refused(f"reading {', '.join(sorted(paths))} is refused: iotlake sql reads "
                              "the lake's tables only")
            raise Refused(f"a {name} relation is refused: iotlake sql reads the lake's tables only")


def _leaves(plan) -> list:
    """Leaves of an analyzed plan, those of its subqueries' plans included."""
    out, todo = [], [plan]
    while todo:
        p = todo.pop()
        kids = _seq(p.children()) + _seq(p.subqueries())
        if not kids:
            out.append(p)
        todo.extend(kids)
    return out


_STATEMENTS = {"CompoundBody": "a SQL script (BEGIN ... END)", "AddJarsCommand": "ADD JAR",
               "AddFilesCommand": "ADD FILE", "AddArchivesCommand": "ADD ARCHIVE",
               "CreateTempViewUsing": "CREATE TEMPORARY VIEW ... USING"}


def _statement(command: str) -> str:
    """A command's class name as a user wrote it, roughly: ``LoadData`` -> ``LOAD DATA``."""
    if command in _STATEMENTS:
        return _STATEMENTS[command]
    words, word = [], ""
    for ch in command.removesuffix("Command"):
        if ch.isupper() and word:
            words.append(word)
            word = ""
        word += ch
    return " ".join([*words, word]).upper()
