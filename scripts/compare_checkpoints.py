"""Compare two saved model folders file by file and tensor by tensor (publisher.testing.checkpoints).

    python scripts/compare_checkpoints.py FOLDER_A FOLDER_B

Shards count as the same when their parsed headers and data bytes are equal (safetensors writes its
__metadata__ map in arbitrary key order), JSON files when they parse equal, other files when their
bytes are. Exit 0 when every file is the same, 1 when any differs, 2 when a folder is missing.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from publisher.testing.checkpoints import compare_checkpoints  # noqa: E402 - after the path insert


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    try:
        result = compare_checkpoints(Path(argv[0]), Path(argv[1]))
    except NotADirectoryError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(result.summary())
    for line in result.differences()[:60]:
        print("  " + line)
    return 0 if result.identical else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
