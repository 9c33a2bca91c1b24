"""Where tables live: a local directory or S3-compatible object storage (``s3://bucket/prefix``).

Spark (delta-spark) reaches ``s3://`` through Hadoop's S3A file system (``hadoop-aws`` and the
AWS SDK v2 modules in ``infra/jvm/spark-jars.pom.xml``), configured by :func:`spark_conf` from
the ``storage`` settings section; its credentials are ``fs.s3a.*`` keys that Spark's
``spark.redaction.regex`` hides in the UI and event logs. Delta commits to S3 through its
``S3SingleDriverLogStore``: safe while each table has one writing driver (one ``iotlake run``,
or one role process per table); Delta's Spark writer has no S3 conditional-write log store.

The readers without a JVM (delta-rs: dashboard, ``iotlake query``, the drivers' cheap look-ups
in ``lakehouse.delta.read``) use :func:`delta_options`; :func:`configure` also exports them as
the standard ``AWS_*`` environment, so every ``DeltaTable(uri)`` in the process reaches the same
store. Error messages go through :func:`scrub`.
"""

from __future__ import annotations

import os
import threading
from urllib.parse import urlparse

import pyarrow.fs as pafs

SCHEMES = ("s3", "s3a")
#: Option keys whose values are credentials (compared upper-case).
SECRET_KEYS = frozenset({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"})


class StorageError(ValueError):
    """The object store is unreachable or refuses the credentials; says what to check."""


def is_uri(path: str | os.PathLike[str]) -> bool:
    """True for object-store URIs (``s3://...``); plain paths and ``file://`` are local."""
    p = str(path)
    return "://" in p and not p.startswith("file://")


def join(base: str, *parts: str) -> str:
    if is_uri(base):
        return "/".join([base.rstrip("/"), *(x.strip("/") for x in parts)])
    return os.path.join(base, *parts)


def delta_options(settings) -> dict[str, str]:
    """delta-rs / object_store options for ``settings.data_root`` ({} for a local root)."""
    if not is_uri(settings.data_root):
        return {}
    st = settings.storage
    opts = {"AWS_REGION": st.region,
            "AWS_S3_ALLOW_UNSAFE_RENAME": "true" if st.allow_unsafe_rename else "false"}
    if st.endpoint_url:
        opts["AWS_ENDPOINT_URL"] = st.endpoint_url
    if st.allow_http:
        opts["AWS_ALLOW_HTTP"] = "true"
    for key, value in (("AWS_ACCESS_KEY_ID", st.access_key_id),
                       ("AWS_SECRET_ACCESS_KEY", st.secret_access_key),
                       ("AWS_SESSION_TOKEN", st.session_token)):
        value = value or os.environ.get(key, "")
        if value:
            opts[key] = value
    opts.update(st.options)
    return opts


def path_style(settings) -> bool:
    """``storage.path_style_access``; unset: path style for a custom endpoint (MinIO, Ceph...)."""
    st = settings.storage
    return bool(st.endpoint_url) if st.path_style_access is None else st.path_style_access


def spark_conf(settings) -> dict[str, str]:
    """Spark confs for an ``s3://`` data root ({} for a local one): S3A serves both ``s3://``
    and ``s3a://`` paths, so table paths are the same for Spark and delta-rs."""
    if not is_uri(settings.data_root):
        return {}
    st = settings.storage
    h = "spark.hadoop.fs.s3a."
    conf = {"spark.hadoop.fs.s3.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem",
            "spark.hadoop.fs.AbstractFileSystem.s3.impl": "org.apache.hadoop.fs.s3a.S3A",
            h + "endpoint.region": st.region,
            h + "path.style.access": str(path_style(settings)).lower()}
    if st.endpoint_url:
        conf[h + "endpoint"] = st.endpoint_url
        conf[h + "connection.ssl.enabled"] = str(not st.endpoint_url.startswith("http://")).lower()
    o = delta_options(settings)
    if o.get("AWS_ACCESS_KEY_ID") and o.get("AWS_SECRET_ACCESS_KEY"):
        conf[h + "access.key"] = o["AWS_ACCESS_KEY_ID"]
        conf[h + "secret.key"] = o["AWS_SECRET_ACCESS_KEY"]
        provider = "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider"
        if o.get("AWS_SESSION_TOKEN"):
            conf[h + "session.token"] = o["AWS_SESSION_TOKEN"]
            provider = "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider"
        conf[h + "aws.credentials.provider"] = provider
    # else: S3A's default chain (environment, web identity, instance profile)
    return conf


_lock = threading.Lock()
_registry: dict[str, dict[str, str]] = {}  # URI root -> options, set by configure()


def configure(settings, export: bool = True) -> dict[str, str]:
    """Remember the options for ``settings.data_root`` and (``export``) put them in os.environ."""
    opts = delta_options(settings)
    if opts:
        with _lock:
            _registry[settings.data_root.rstrip("/")] = opts
        if export:
            os.environ.update({k.upper(): v for k, v in opts.items() if k.upper().startswith("AWS_")})
    return opts


def env_options() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("AWS_")}


def options_for(path: str) -> dict[str, str]:
    """Options for a table path: those configured for its root, else the AWS_* environment."""
    if not is_uri(path):
        return {}
    with _lock:
        roots = sorted((r for r in _registry if path == r or path.startswith(r + "/")), key=len)
        if roots:
            return dict(_registry[roots[-1]])
    return env_options()


def scrub(text: str, options: dict[str, str] | None = None) -> str:
    """``text`` with every credential value in ``options`` (or the environment) replaced."""
    opts = options if options is not None else env_options()
    for k, v in opts.items():
        if k.upper() in SECRET_KEYS and v:
            text = text.replace(v, "***")
    return text


_fs_cache: dict[tuple, pafs.FileSystem] = {}


def filesystem(path: str, options: dict[str, str] | None = None) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it) for a local path or an ``s3://`` URI."""
    if not is_uri(path):
        return pafs.LocalFileSystem(), str(path)
    scheme, rest = str(path).split("://", 1)
    if scheme not in SCHEMES:
        raise StorageError(f"{path}: only {', '.join(s + '://' for s in SCHEMES)} URIs are supported")
    o = {k.upper(): v for k, v in (options if options is not None else options_for(path)).items()}
    key = tuple(sorted(o.items()))
    fs = _fs_cache.get(key)
    if fs is None:
        kw: dict = {"region": o.get("AWS_REGION") or o.get("AWS_DEFAULT_REGION") or None,
                    "access_key": o.get("AWS_ACCESS_KEY_ID"), "secret_key": o.get("AWS_SECRET_ACCESS_KEY"),
                    "session_token": o.get("AWS_SESSION_TOKEN")}
        endpoint = o.get("AWS_ENDPOINT_URL") or o.get("AWS_ENDPOINT")
        if endpoint:
            u = urlparse(endpoint)
            kw.update(endpoint_override=u.netloc or u.path, scheme=u.scheme or "https")
        fs = _fs_cache[key] = pafs.S3FileSystem(**{k: v for k, v in kw.items() if v})
    return fs, rest


def exists(path: str, options: dict[str, str] | None = None) -> bool:
    if not is_uri(path):
        return os.path.exists(path)
    fs, p = filesystem(path, options)
    return fs.get_file_info(p).type != pafs.FileType.NotFound


def is_dir(path: str, options: dict[str, str] | None = None) -> bool:
    if not is_uri(path):
        return os.path.isdir(path)
    fs, p = filesystem(path, options)
    return fs.get_file_info(p).type == pafs.FileType.Directory


def read_text(path: str, options: dict[str, str] | None = None) -> str:
    if not is_uri(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    fs, p = filesystem(path, options)
    with fs.open_input_stream(p) as f:
        return f.read().decode()


def list_names(path: str, options: dict[str, str] | None = None) -> list[str]:
    """File names directly under a directory / prefix ([] when it does not exist)."""
    if not is_uri(path):
        return os.listdir(path) if os.path.isdir(path) else []
    fs, p = filesystem(path, options)
    infos = fs.get_file_info(pafs.FileSelector(p, allow_not_found=True))
    return [i.base_name for i in infos if i.type == pafs.FileType.File]


def delete(path: str, options: dict[str, str] | None = None) -> None:
    """Delete a file; a missing file is fine."""
    fs, p = filesystem(path, options)
    try:
        fs.delete_file(p)
    except FileNotFoundError:
        pass


def check(settings) -> None:
    """Fail fast, with a message naming what to fix, when the object store refuses us."""
    if not is_uri(settings.data_root):
        return
    opts = delta_options(settings)
    try:
        fs, p = filesystem(settings.data_root, opts)
        fs.get_file_info(pafs.FileSelector(p, allow_not_found=True))
    except OSError as e:
        msg = scrub(str(e).splitlines()[0] if str(e) else type(e).__name__, opts)
        raise StorageError(
            f"cannot access {settings.data_root} (endpoint {opts.get('AWS_ENDPOINT_URL', 'AWS')}): "
            f"{msg}. Check storage.access_key_id / storage.secret_access_key (or their *_file "
            f"variants, or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), storage.endpoint_url and "
            f"that the bucket exists") from None
