"""A user's own code and data, from the job file to the store: ``hadar submit`` with ``code:``
and ``hadar data put|ls``.

A job file that gives ``code: DIR`` runs the user's script instead of a built-in model::

    model: digits-cnn          # the user's name for the model (a label)
    code: .                    # the folder to pack, relative to the job file
    entrypoint: train.py       # the script in it (a relative .py path)
    args: [--width, "64"]      # its command line (optional)
    config: {lr: 0.1}          # a mapping the script reads as run.config (optional)
    data: digits               # a dataset uploaded with `hadar data put` (optional)
    hint: resnet               # a built-in family to estimate its speed by until measured (optional)

:func:`deliver` packs DIR reproducibly (:func:`shared.domain.bundles.pack`: the same tree
gives the same bytes), uploads the bundle under the submitting user's prefix only if that
digest is not stored yet, resolves ``data`` to the bundle its name stands for now (so the job
is pinned to exact bytes), and returns the :class:`~shared.wire.events.UserCode` the JobSpec
carries. ``hadar data put DIR NAME`` uploads a dataset folder the same way (larger limits)
and points NAME at it. Every refusal is one line that says what to change.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from services.cli.user_logins import store_user, user_store
from shared.domain.bundles import CODE_LIMITS, DATA_LIMITS, BundleError, BundleLimits, PackedBundle, human_bytes, pack
from shared.domain.layout import code_bundle_key, data_bundle_key, dataset_key, dataset_prefix
from shared.errors import UsageError
from shared.runtime.connection import add_store_args
from shared.store import ObjectNotFound, ObjectStore
from shared.wire.records import DATASET_RE, DIGEST_RE, MAX_CONFIG_CHARS, USER_RE, UserCode

__all__ = ["CODE_FIELDS", "CodeRequest", "split_code_fields", "deliver", "register", "upload_dataset"]

T = TypeVar("T")
CODE_FIELDS = ("code", "entrypoint", "args", "config", "data", "hint")
MAX_POINTER_BYTES = 4096


class CodeFieldError(UsageError):
    """A bad ``code``/``entrypoint``/``args``/``config``/``data``/``hint`` value; the message
    starts with the field name."""


@dataclass(frozen=True, kw_only=True)
class CodeRequest:
    """What a job file asks for its own code, checked but not yet packed or uploaded."""

    folder: Path
    entrypoint: str
    args: tuple[str, ...]
    config: str
    data: str
    hint: str


def split_code_fields(data: Mapping[str, Any], *, base: Path) -> tuple[dict[str, Any], CodeRequest | None]:
    """The job fields without the code fields, and the code request (None for a zoo job).
    ``code`` is a folder relative to ``base`` (the job file's folder, or the working one)."""
    fields = {k: v for k, v in data.items() if k not in CODE_FIELDS}
    given = {k: data[k] for k in CODE_FIELDS if data.get(k) is not None}
    if not given:
        return fields, None
    if "code" not in given:
        raise CodeFieldError(f"{sorted(given)[0]}: only for a job with code: DIR (your own script)")
    if "dataset" in fields:
        raise CodeFieldError("dataset: a job with code names its data with data: NAME (see hadar data put)")
    folder = given["code"]
    if not isinstance(folder, str) or not folder:
        raise CodeFieldError(f"code: must be a folder, got {folder!r}")
    path = (base / folder).resolve()
    if not path.is_dir():
        raise CodeFieldError(f"code: {path} is not a folder")
    entrypoint = given.get("entrypoint", "train.py")
    if not isinstance(entrypoint, str) or not (path / entrypoint).is_file():
        raise CodeFieldError(f"entrypoint: {entrypoint!r} is not a file in {path}")
    return fields, CodeRequest(folder=path, entrypoint=entrypoint, args=_args(given.get("args", [])),
                               config=_config(given.get("config")), data=_name("data", given.get("data", "")),
                               hint=_text("hint", given.get("hint", ""), 32))


def _args(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        import shlex
        value = shlex.split(value)
    if not isinstance(value, list) or not all(isinstance(a, (str, int, float)) for a in value):
        raise CodeFieldError(f"args: must be a list of strings, got {value!r}"[:200])
    return tuple(str(a) for a in value)


def _config(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise CodeFieldError("config: not a JSON object") from None
    if not isinstance(value, dict):
        raise CodeFieldError(f"config: must be a mapping, got {type(value).__name__}")
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CodeFieldError(f"config: not JSON-serialisable: {exc}") from None
    if len(text) > MAX_CONFIG_CHARS:
        raise CodeFieldError(f"config: {len(text)} characters as JSON, over {MAX_CONFIG_CHARS}")
    return text


def _name(field: str, value: Any) -> str:
    if value in ("", None):
        return ""
    if not isinstance(value, str) or DATASET_RE.fullmatch(value) is None:
        raise CodeFieldError(f"{field}: {value!r} must be 1-63 of lowercase letters, digits, '.', '_', '-'")
    return value


def _text(field: str, value: Any, limit: int) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise CodeFieldError(f"{field}: must be text of at most {limit} characters")
    return value


def check_user(user: str) -> str:
    if USER_RE.fullmatch(user) is None:
        raise UsageError(f"user: {user!r} cannot own code or data in the store; give --user NAME "
                         "(1-63 of lowercase letters, digits, '.', '_', '-')")
    return user


async def _upload_if_absent(store: ObjectStore, key: str, bundle: PackedBundle) -> bool:
    """Upload ``bundle`` at ``key`` unless it is there already; True if it was uploaded. A
    key is a digest, so an object there holds the same bytes (agents verify them anyway)."""
    if await store.exists(key):
        return False
    await store.put_file(key, bundle.path)
    return True


def _pack(folder: Path, out: Path, limits: BundleLimits) -> PackedBundle:
    try:
        return pack(folder, out, limits=limits)
    except BundleError as exc:
        raise UsageError(str(exc)) from None


async def resolve_dataset(store: ObjectStore, user: str, name: str) -> tuple[str, int]:
    """(digest, size) of the bundle ``user``'s dataset ``name`` stands for now."""
    try:
        raw = await store.get(dataset_key(user, name))
    except ObjectNotFound:
        raise UsageError(f"data: {user} has no dataset {name!r}; upload it with hadar data put DIR {name}") from None
    try:
        pointer = json.loads(raw[:MAX_POINTER_BYTES])
        digest, size = pointer["digest"], pointer["size"]
        if not (isinstance(digest, str) and DIGEST_RE.fullmatch(digest) and isinstance(size, int) and size > 0):
            raise ValueError
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"data: the record of dataset {name!r} is damaged; upload it again") from None
    return digest, size


async def deliver(store: ObjectStore, request: CodeRequest, user: str,
                  accept: Callable[[UserCode], Awaitable[T]]) -> tuple[T, bool]:
    """Pack the code, resolve its data, and hand the job's :class:`UserCode` to ``accept``
    (which validates the job and may refuse it by raising); only then upload the bundle if
    its digest is new. Returns what ``accept`` returned and whether this call uploaded."""
    check_user(user)
    data_digest, data_size = await resolve_dataset(store, user, request.data) if request.data else ("", 0)
    with tempfile.TemporaryDirectory(prefix="hadar-code-") as tmp:
        bundle = await asyncio.to_thread(_pack, request.folder, Path(tmp) / "code.tar", CODE_LIMITS)
        code = UserCode(digest=bundle.digest, size=bundle.size, entrypoint=request.entrypoint, args=request.args,
                        config=request.config, data_digest=data_digest, data_size=data_size, hint=request.hint)
        accepted = await accept(code)
        uploaded = await _upload_if_absent(store, code_bundle_key(user, bundle.digest), bundle)
    return accepted, uploaded


async def upload_dataset(store: ObjectStore, folder: Path, user: str, name: str) -> dict[str, Any]:
    """Pack ``folder``, upload it if its digest is new, and point ``name`` at it."""
    check_user(user)
    _name("name", name)
    with tempfile.TemporaryDirectory(prefix="hadar-data-") as tmp:
        bundle = await asyncio.to_thread(_pack, folder, Path(tmp) / "data.tar", DATA_LIMITS)
        uploaded = await _upload_if_absent(store, data_bundle_key(user, bundle.digest), bundle)
    pointer = {"name": name, "digest": bundle.digest, "size": bundle.size, "files": bundle.files,
               "uploaded_at": time.time()}
    await store.put(dataset_key(user, name), json.dumps(pointer, sort_keys=True).encode())
    return {**pointer, "user": user, "uploaded": uploaded}


async def list_datasets(store: ObjectStore, user: str) -> list[dict[str, Any]]:
    out = []
    for key in sorted(await store.list(dataset_prefix(check_user(user)))):
        try:
            pointer = json.loads((await store.get(key))[:MAX_POINTER_BYTES])
        except (ValueError, ObjectNotFound):
            continue
        if isinstance(pointer, dict):
            out.append(pointer)
    return out


# ---------------------------------------------------------------- hadar data


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="your datasets in the store: 'data put DIR NAME' uploads, 'data ls' lists")
    actions = p.add_subparsers(dest="data_action", required=True)
    put = actions.add_parser("put", help="upload a folder as dataset NAME (a job names it with data: NAME)")
    put.add_argument("folder", help="the dataset's folder (regular files and folders; .hadarignore honoured)")
    put.add_argument("name", help="the dataset's name (lowercase letters, digits, '.', '_', '-')")
    ls = actions.add_parser("ls", help="list your datasets")
    for q in (put, ls):
        q.add_argument("--user", default=None, help="owner (default: your login name)")
        q.add_argument("--json", action="store_true", help="print one JSON document on stdout")
        add_store_args(q)
    put.set_defaults(func=cmd_data_put)
    ls.set_defaults(func=cmd_data_ls)


def cmd_data_put(args: argparse.Namespace) -> int:
    folder = Path(args.folder)
    if not folder.is_dir():
        raise UsageError(f"folder: {folder} is not a folder")
    user = store_user(args.user)

    async def run() -> dict[str, Any]:
        store = user_store(args)
        await store.start()
        try:
            return await upload_dataset(store, folder, user, args.name)
        finally:
            await store.stop()

    doc = asyncio.run(run())
    if args.json:
        print(json.dumps(doc, sort_keys=True))
    else:
        how = "uploaded" if doc["uploaded"] else "already stored"
        print(f"{user}/{doc['name']}: {doc['files']} files, {human_bytes(doc['size'])}, "
              f"sha256 {doc['digest'][:12]} ({how})")
    return 0


def cmd_data_ls(args: argparse.Namespace) -> int:
    user = store_user(args.user)

    async def run() -> list[dict[str, Any]]:
        store = user_store(args)
        await store.start()
        try:
            return await list_datasets(store, user)
        finally:
            await store.stop()

    found = asyncio.run(run())
    if args.json:
        print(json.dumps(found, sort_keys=True))
        return 0
    for d in found:
        print(f"{d.get('name')}\t{d.get('files')} files\t{human_bytes(int(d.get('size', 0)))}\t"
              f"sha256 {str(d.get('digest'))[:12]}")
    return 0
