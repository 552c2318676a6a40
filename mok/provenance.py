"""Which code ran: the commit that benchmark rows, training runs and GPU test logs record.

The commit is that of the git work tree holding the imported mok package (this file's folder),
never that of the directory a run starts in: a run started from another checkout, or one that
imports a mok from elsewhere on the path, records the mok that actually ran.

Resolution, first match wins:
  1. MOK_COMMIT, when set: for a copy of the tree without .git, or whose .git is not the code's
     history (mok._env reads it).
  2. git: the short HEAD of the work tree that tracks this package, with "-dirty" when tracked
     files differ from it (untracked files do not count).
  3. the package version, "mok-<version>": an installed package outside any git work tree.
"""

from __future__ import annotations

import os
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent

# Variables that would point git at another repository than the one around the package.
_GIT_REDIRECTS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY",
                  "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_COMMON_DIR", "GIT_NAMESPACE",
                  "GIT_PREFIX")


def _git(args: list[str], cwd: Path) -> str:
    """git's stdout for args run in cwd; raises OSError or CalledProcessError on failure."""
    env = {key: value for key, value in os.environ.items() if key not in _GIT_REDIRECTS}
    # A reader only: no index refresh, so it never takes index.lock from a concurrent commit.
    env["GIT_OPTIONAL_LOCKS"] = "0"
    return subprocess.run(["git", *args], cwd=cwd, env=env, text=True, capture_output=True,
                          check=True, timeout=30).stdout.strip()


def git_commit(package_dir: Path = PACKAGE_DIR) -> str | None:
    """The short HEAD of the git work tree that tracks package_dir, plus "-dirty" when tracked
    files differ from HEAD; None when no git work tree tracks it (or git is missing)."""
    try:
        # Tracked, not merely inside a work tree: a package installed into a virtualenv that
        # sits (ignored) inside some checkout is not that checkout's code.
        _git(["ls-files", "--error-unmatch", "--", "__init__.py"], package_dir)
        head = _git(["rev-parse", "--short", "HEAD"], package_dir)
        dirty = _git(["status", "--porcelain", "--untracked-files=no"], package_dir)
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "") if head else None


def package_version() -> str | None:
    """The imported package's version as "mok-<version>" (its __version__, else the installed
    distribution's metadata); None when neither says."""
    import mok

    version = getattr(mok, "__version__", None)
    if not version:
        try:
            version = metadata.version("mok")
        except metadata.PackageNotFoundError:
            return None
    return f"mok-{version}"


def resolve_commit() -> tuple[str, str]:
    """(commit, where it came from): where is "MOK_COMMIT", "git" or "package version", or
    ("unknown", "nothing") when no source answers."""
    from mok import _env

    override = _env.COMMIT.strip()
    if override and override != "unknown":
        return override, "MOK_COMMIT"
    commit = git_commit()
    if commit is not None:
        return commit, "git"
    version = package_version()
    if version is not None:
        return version, "package version"
    return "unknown", "nothing"


def commit_id() -> str:
    """The commit a run records: MOK_COMMIT when set, else the git commit (+ -dirty) of the work
    tree holding the imported mok package, else "mok-<version>"."""
    return resolve_commit()[0]
