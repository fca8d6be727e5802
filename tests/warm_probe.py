"""What a process sees of how it was started, for tests/test_warm_start.py.

python -m warm_probe report [ARG ...]   prints it as JSON, exits with status 3
python -m warm_probe raise              an uncaught ValueError
python -m warm_probe sleep              waits to be signalled
"""

import json
import os
import sys
import time

if __name__ == "__main__":
    what = sys.argv[1]
    if what == "report":
        print(
            json.dumps(
                {
                    "argv": sys.argv,
                    "cwd": os.getcwd(),
                    "path0": sys.path[0],
                    "parent": os.getppid(),
                    "stdin": sys.stdin.read(),
                    "password": os.environ.get("REDIS_PASSWORD"),
                    "tf_log_level": os.environ.get("TF_CPP_MIN_LOG_LEVEL"),
                    "name": __name__,
                    "session": os.getsid(0) == os.getpid(),
                }
            )
        )
        print("to stderr", file=sys.stderr)
        sys.exit(3)
    if what == "raise":
        raise ValueError("raised by the probe")
    if what == "sleep":
        print("sleeping", flush=True)
        time.sleep(600)
