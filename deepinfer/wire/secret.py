"""The per-deployment secret every frame between DeepInfer processes is signed with.

Where it comes from, first match wins:
  1. `--cluster-secret-file PATH` (multi-host: the same file on every host), exported into
     this process's environment so the processes it starts inherit it;
  2. the environment variable DEEPINFER_CLUSTER_SECRET (set by a parent process or the
     operator);
  3. neither: a random one is generated and exported the same way.
The secret travels only through files and process environments, never a command line (which
any local user can read in /proc). The signing key is derived from it, so the raw secret is
never used as a MAC key directly.
"""
from __future__ import annotations

import hashlib
import logging
import os
import secrets
import stat

logger = logging.getLogger(__name__)

SECRET_ENV = "DEEPINFER_CLUSTER_SECRET"
MIN_SECRET_CHARS = 16


class ClusterSecretError(ValueError):
    """The configured secret is unusable (missing file, too short, not text)."""


def read_secret_file(path: str) -> str:
    """The secret in `path` (surrounding whitespace stripped); warns when others can read it."""
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 16)
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ClusterSecretError(f"cannot read --cluster-secret-file {path}: {exc}") from None
    try:
        value = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ClusterSecretError(f"--cluster-secret-file {path} is not UTF-8 text") from None
    _check(value, f"--cluster-secret-file {path}")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("cluster secret file %s is readable by other users (chmod 600 it)", path)
    return value


def _check(value: str, where: str) -> None:
    if len(value) < MIN_SECRET_CHARS or "\x00" in value:
        raise ClusterSecretError(f"{where}: the cluster secret must be at least "
                                 f"{MIN_SECRET_CHARS} characters of text")


def ensure_cluster_secret(secret_file: str | None = None) -> str:
    """This process's secret, exported to its environment so child processes inherit it;
    generated at random when none is configured."""
    if secret_file:
        os.environ[SECRET_ENV] = read_secret_file(secret_file)
    value = os.environ.get(SECRET_ENV)
    if value is None:
        value = os.environ[SECRET_ENV] = secrets.token_hex(32)
    else:
        _check(value, SECRET_ENV)
    return value


def cluster_key() -> bytes:
    """The HMAC key of this deployment (derived from the secret, domain-separated)."""
    return derive_key(ensure_cluster_secret())


def derive_key(secret: str) -> bytes:
    return hashlib.sha256(b"deepinfer wire key v1\x00" + secret.encode("utf-8")).digest()


def key_id(key: bytes) -> bytes:
    """4 bytes naming a key, so a frame signed with another deployment's key is reported as
    such rather than as tampering. Reveals nothing usable about the key."""
    return hashlib.sha256(b"deepinfer key id\x00" + key).digest()[:4]
