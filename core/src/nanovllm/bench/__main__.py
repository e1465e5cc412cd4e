"""``python -m nanovllm.bench JOB_JSON``: one benchmark job, its result rows as JSON on the last line."""

import json
import sys

from nanovllm.bench import run_job

if __name__ == "__main__":
    rows = run_job(json.loads(sys.argv[1]))
    sys.stdout.flush()
    print(json.dumps(rows), flush=True)
