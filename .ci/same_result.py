"""Fails unless the pages that show the README's training command's final line show the
line that command printed in this run (the best evaluation and its epoch; the speed and
the time vary from machine to machine): a page may not keep a result the code no longer
reaches.

    ncf-main --dataset synthetic --train_epochs 3 --seed 1 | tee /tmp/ncf-main.out
    python .ci/same_result.py /tmp/ncf-main.out README.md docs/offline.md
"""

import re
import sys

RESULT = re.compile(r"best HR@10=[0-9.]+ NDCG@10=[0-9.]+ \(epoch \d+\)")


def main(printed_path: str, *pages: str) -> int:
    with open(printed_path) as printed:
        found = RESULT.findall(printed.read())
    if not found:
        print(f"error: no 'best HR@10=...' line in {printed_path}", file=sys.stderr)
        return 1
    printed_result, wrong = found[-1], []
    for page in pages:
        with open(page) as text:
            shown = RESULT.findall(text.read())
        if not shown:
            wrong.append(f"{page} shows no result line")
        wrong += [f"{page} shows {line!r}" for line in shown if line != printed_result]
    for line in wrong:
        message = f"error: {line}, the command printed {printed_result!r}: fix the page"
        print(message, file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
