"""Storage over fsspec URLs.

``file://`` (the default) writes each file whole and durable (an unnamed inode, fsync, link,
directory fsync; :mod:`dstl_ray.storage.local`), so a reader never sees a half-written file;
``memory://`` is for unit tests in one process; ``s3://`` goes through s3fs as one put
(multipart only when large). Paths are full URLs; storages are cached
per (protocol, options) in each process.

S3 options (:func:`s3_options`): endpoint and credentials come from the config
(``s3_endpoint_url``, ``s3_access_key_id``, ``s3_secret_access_key``, ``storage_options``) or
else the standard variables (``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``) and the AWS credential
chain. The client's own retries are off: dstl-ray's :class:`~dstl_ray.upload.uploader.Uploader` owns the
retry policy and hedging, so attempts are counted honestly. Credentials are never logged: a
storage's ``repr`` shows its options redacted.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ..config import ChangelogConfig, parse_json_object
from ..errors import ConfigError
from .base import Storage, split_protocol
from .fsspec import FsspecStorage
from .local import LocalStorage

_cache: dict[tuple[str, str], Storage] = {}

# Storage wrappers that extensions outside the runtime register when imported, by the option
# that turns them on: ``fault_spec`` (dstl_ray.testing.faults). The runtime never imports them;
# a process that needs one imports its module, or has it imported by option ``plugins``.
WRAPPER_OPTIONS = ("fault_spec",)
StorageWrapper = Callable[[Storage, str], Storage]  # (storage, the option's value) -> storage
_wrappers: dict[str, StorageWrapper] = {}


_lock = threading.Lock()


def _env(*names: str) -> str:
    for n in names:
        v = os.environ.get(n)
        if v:
            return v
    return ""


def s3_options(config: ChangelogConfig | None = None) -> dict[str, Any]:
    """s3fs options: config first, then the standard AWS variables; the client's retries
    are off (the Uploader owns the retry policy). Contains credentials: never log it."""
    endpoint = (config.s3_endpoint_url if config else "") or _env(
        "DSTL_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    key = (config.s3_access_key_id if config else "") or _env("AWS_ACCESS_KEY_ID")
    secret = (config.s3_secret_access_key if config else "") or _env("AWS_SECRET_ACCESS_KEY")
    opts: dict[str, Any] = {
        "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 1}}}
    if endpoint:
        opts["endpoint_url"] = endpoint
    if key and secret:
        opts["key"], opts["secret"] = key, secret
        token = _env("AWS_SESSION_TOKEN")
        if token and not (config and config.s3_access_key_id):
            opts["token"] = token
    region = _env("AWS_REGION", "AWS_DEFAULT_REGION")
    if region:
        opts["client_kwargs"] = {"region_name": region}
    extra = parse_json_object("storage_options", config.storage_options) if config else {}
    for k, v in extra.items():  # nested dicts merge, so a region does not drop the retries
        if isinstance(v, dict) and isinstance(opts.get(k), dict):
            opts[k] = {**opts[k], **v}
        else:
            opts[k] = v
    json.dumps(opts)  # options must be plain data (they key the cache)
    return opts


def get_storage(url: str, options: Mapping[str, Any] | None = None,
                multipart_threshold: int | None = None) -> Storage:
    """The (cached) storage for ``url``'s protocol. ``s3://`` without ``options`` takes them
    from the environment (:func:`s3_options`)."""
    proto, _ = split_protocol(url)
    if options is None and proto in ("s3", "s3a"):
        options = s3_options()
    key = (proto, json.dumps([options or {}, multipart_threshold], sort_keys=True,
                             default=repr))
    with _lock:
        st = _cache.get(key)
        if st is None:
            if proto == "file":
                st = LocalStorage()
            elif multipart_threshold is not None:
                st = FsspecStorage(proto, options, multipart_threshold)
            else:
                st = FsspecStorage(proto, options)
            _cache[key] = st
        return st


def storage_for(url: str, config: ChangelogConfig) -> Storage:
    """The storage a node (or direct transport) writes ``url`` with under ``config``:
    S3 options from the config, wrapped by the registered wrapper of each option that is set
    (fault injection for ``fault_spec``: a fresh wrapper per call, so each uploader has its
    own fault script), after importing the config's ``plugins``."""
    proto, _ = split_protocol(url)
    if proto in ("s3", "s3a"):
        st = get_storage(url, s3_options(config), config.s3_multipart_threshold)
    else:
        st = get_storage(url, parse_json_object("storage_options", config.storage_options)
                         or None)
    return _wrapped(st, config)


def register_storage_wrapper(option: str, wrap: StorageWrapper) -> None:
    """``storage_for`` wraps every storage in ``wrap`` while ``option`` is set."""
    if option not in WRAPPER_OPTIONS:
        raise ValueError(f"option {option!r} turns on no storage wrapper "
                         f"(one of {', '.join(WRAPPER_OPTIONS)})")
    _wrappers[option] = wrap


def _wrapped(st: Storage, config: ChangelogConfig) -> Storage:
    config.load_plugins()
    for option in WRAPPER_OPTIONS:
        value = getattr(config, option)
        if not value:
            continue
        wrap = _wrappers.get(option)
        if wrap is None:  # never write without the faults a test asked for
            raise ConfigError(f"option {option} is set, but nothing in this process handles "
                              f"it: name the module that does in option plugins (e.g. "
                              f"plugins=dstl_ray.testing)")
        st = wrap(st, value)
    return st
