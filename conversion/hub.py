"""Upload a converted folder to the Hugging Face Hub (`roformer-rope convert-tf ... --push-to-hub REPO_ID`).

The token is read the usual `huggingface_hub` way (`HF_TOKEN`, or the file `hf auth login` writes);
`--dry-run` only lists what would be uploaded and never touches the network.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import HfApi

from .key_map import ConversionError

# Never part of a model repo: editor/OS litter and Python caches a payload folder may pick up.
IGNORE_PATTERNS = ["**/__pycache__/**", "*.pyc", ".DS_Store", "**/.git/**"]


def list_upload(folder: str | Path) -> list[tuple[str, int]]:
    """(relative path, size in bytes) of every file `push_folder` would upload, sorted by path."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder to upload")
    files = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = path.relative_to(folder).as_posix()
        parts = relative.split("/")
        if "__pycache__" in parts or ".git" in parts or relative.endswith(".pyc") or path.name == ".DS_Store":
            continue
        files.append((relative, path.stat().st_size))
    return files


def format_size(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def check_repo_id(repo_id: str) -> None:
    """ConversionError unless `repo_id` is a valid Hub id: checked before converting, so a typo costs nothing and
    is never written into a model card."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ConversionError(f"--push-to-hub {repo_id!r}: not a Hub repo id ({error})") from None


def push_folder(
    folder: str | Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    dry_run: bool = False,
    commit_message: str = "Add RoFormer converted from the original TensorFlow checkpoint",
) -> str | None:
    """Create `repo_id` if needed and upload `folder` (to branch `revision`); returns the repo URL.

    With `dry_run` the files and sizes are printed and nothing is sent (returns None).
    """
    files = list_upload(folder)
    where = f"{repo_id}" + (f" (branch {revision})" if revision else "") + (" [private]" if private else "")
    if dry_run:
        print(f"dry run: would upload {len(files)} files to {where}:")
        for name, size in files:
            print(f"  {name:<40} {format_size(size):>10}")
        print(f"  total {format_size(sum(size for _, size in files))}")
        return None
    api = HfApi()
    url = api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
    if revision:
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    api.upload_folder(
        folder_path=str(folder),
        repo_id=repo_id,
        repo_type="model",
        revision=revision,
        commit_message=commit_message,
        ignore_patterns=IGNORE_PATTERNS,
    )
    url = str(url).rstrip("/") + (f"/tree/{revision}" if revision else "")
    print(f"uploaded {len(files)} files to {url}")
    return url
