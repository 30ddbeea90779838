"""What an interrupted publish run removes, and what it keeps on purpose for the re-run that resumes it.

SIGINT / SIGTERM (publisher.signals) unwind the run: the stages' own cleanup removes their temporary folders,
kills the worker process groups and deletes a repo the run created; ``discard_unfinished`` then removes the
output the run had not finished, and ``kept_for_resume`` says what stays (the downloads in the Hugging Face
cache, finished components in the resume cache) for the one-line message.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from publisher.errors import Interrupted
from publisher.stages.plan import Plan
from publisher.stages.quantize import partial_folder
from publisher.stages.resume import ComponentCache, default_root


def kept_for_resume(plan: Plan, fingerprints: list[str]) -> list[str]:
    """What an interrupted run keeps for a re-run: the base files downloaded so far (Hub bases), and the quantized
    components finished under one of ``fingerprints`` (the recipes' states) in the resume cache."""
    from huggingface_hub import constants

    kept = []
    if plan.source.repo_id:
        kept.append(f"the base files downloaded so far, in the Hugging Face cache ({constants.HF_HUB_CACHE})")
    names = [c.name for c in plan.quantized]
    stored = sorted({label for fp in fingerprints for label in ComponentCache(default_root(), fp).stored(names)})
    if stored:
        kept.append(f"the quantized {', '.join(stored)} in the resume cache ({default_root()})")
    return kept


def discard_unfinished(out_root: Path, finals: dict[str, Path], *, auto_dir: bool, existed: bool,
                       exc: BaseException) -> None:
    """Remove what the run made and did not finish: its .partial folders, its own temporary output folder, an output
    folder it created. A folder already finished and verified stays, and is named in ``exc.left``."""
    if auto_dir:  # a temporary folder of ours whose name the user never saw
        shutil.rmtree(out_root, ignore_errors=True)
        return
    for folder in finals.values():
        shutil.rmtree(partial_folder(folder, out_root), ignore_errors=True)
        if (folder / "README.md").is_file():  # finalize() moves the card in last: a finished, verified folder
            if isinstance(exc, Interrupted):
                exc.left.append(f"the verified folder {folder}")
        elif folder == out_root:  # --output-dir was empty (or held only our leftovers) when the run began
            for entry in list(folder.iterdir()) if folder.is_dir() else []:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        else:
            shutil.rmtree(folder, ignore_errors=True)
    if not existed and out_root.is_dir() and not any(out_root.iterdir()):
        out_root.rmdir()
