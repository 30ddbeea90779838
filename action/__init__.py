"""The GitHub Action's glue (action.yml runs action/main.py): not part of the hf-ao-publish wheel.

Modules, in the order the steps use them:

    workflow  workflow commands (::error::, groups, masks, stop-commands), step outputs, the job summary file
    inputs    HFAO_* variables -> the CLI's argv list (never through a shell); ActionInputError
    disk      the opt-in free-disk step
    install   the venv with the pinned torch and the action's own copy of the tool
    result    the CLI's --json result and the action's outputs derived from it
    summary   the job summary markdown
    run       the publish step: run the CLI, then annotations, summary and outputs
    main      the entry point: `python3 -I action/main.py check|free-disk|install|run|torch-index BUILD`

Everything here is stdlib-only and keeps Python 3.8 syntax: it runs under the runner's python3, before and
apart from the interpreter the tool is installed in.
"""
